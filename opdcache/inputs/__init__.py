"""What a job reads before any engine runs: prompts and their verifiers, model folders and names, fingerprints and
lineage of the files a cache was built from.
"""
