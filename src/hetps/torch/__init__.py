"""PyTorch integration: models, data, DistributedOptimizer, training loop."""
