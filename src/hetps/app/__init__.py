"""``hetps train``, the app above the library: Fashion-MNIST models and data, one training loop
per mode, checkpoints, TensorBoard, and a local cluster started through :mod:`hetps.launch`.

The library (:mod:`hetps.kv`, :mod:`hetps.torch`) never imports this package; a script of
your own uses the library the same way this app does. :mod:`hetps.app.clicks` is the
Criteo-shaped click data the DLRM example and the sparse benchmark train on.
"""
