"""Shipped AligneR checkpoints (folders loadable with AlignerModel.from_pretrained)."""
