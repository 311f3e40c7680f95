"""Runtime: moves plans to ranks. The loader cuts epochs into global batches, gets each rank its
plan (planned locally or by background planner processes through a store) and builds the
micro-batch tensors the plan describes."""
