"""tfcli's own Transformer: configuration, presets, the model, attention, masks, counting and
the reference loaders. Importing this package does not import torch."""
