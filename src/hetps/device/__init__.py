"""The device wing: CUDA tensors on their way to and from the servers, and servers that sum
and step on a GPU.

- :mod:`.staging`: a worker's device tensors staged through reused page-locked host buffers,
  copies on a side stream ordered by events (``Backend``; ``CudaBackend`` over ``TorchCuda``)
- :mod:`.aggregator`: ``HETPS_SERVER_DEVICE``: a server's round aggregator with the float keys
  summed on a device, and each optimizer's ``device_step`` run there (the step lives beside
  the optimizer's host step, in :mod:`hetps.optim`)
"""
