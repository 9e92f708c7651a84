"""The teacher's side of a cache: rollouts of pi_ref, scoring them with one teacher or several (cross-tokenizer ones
through an alignment), the commands that read a scored table back against its engine (audit, mismatch-report, plan,
compare, consistency, upgrade), and the executors that spread a job over processes.
"""
