"""A sequence-parallel size per micro-batch (DCP): groupings of the data-parallel columns planned per
step (``groups``); what each grouping's attention and collectives cost is the cost model's."""
