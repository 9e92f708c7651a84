"""The cache format: the manifest, the schema of each format version, shards and their checks, side files, validation,
the cache as a whole (opening it, writing and finalizing its tables), and what reads it elsewhere (info, the dataset
card, export, the Hub).
"""
