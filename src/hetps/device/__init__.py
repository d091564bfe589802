"""The device wing: a worker's CUDA tensors staged to and from the servers (:mod:`.staging`),
and servers that sum and run optimizers' device steps on a GPU (:mod:`.aggregator`)."""
