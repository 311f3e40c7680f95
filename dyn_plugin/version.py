"""The plugin's version, at the bottom of the house: what ranks compare before they share plans
(``cost.native.build``) and what a checkpoint's marker records."""

__version__ = "0.1.0"
