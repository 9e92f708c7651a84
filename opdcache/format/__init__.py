"""The cache format: the manifest, the schema of each format version, shards and their checks, side files, validation,
the cache as a whole (open, finalize, upgrade records), and what reads it elsewhere (info, card, export, the Hub).
"""
