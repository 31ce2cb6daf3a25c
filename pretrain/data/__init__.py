"""Datasets as WebDataset shards: preparing them from raw sources and streaming them."""
