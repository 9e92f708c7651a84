"""Evaluating a student: held-out accuracy and pass@k with any verifier, through the engines build-rollouts uses."""
