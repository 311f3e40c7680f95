"""Stand-in for ``six`` where it is not installed: Megatron-LM's ``bert_tokenization`` imports it and reads
only ``six.PY2`` / ``six.PY3`` (tests/test_megatron_lm.py puts this folder on the path only then)."""

PY2 = False
PY3 = True
