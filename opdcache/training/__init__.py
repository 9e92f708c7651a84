"""Training from a cache: the loader and its packed batches, the objective and its losses and estimators, the student,
its checkpoints and schedule, online teachers, and SFT of pi_ref.
"""
