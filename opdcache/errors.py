"""The exceptions opdcache raises.

One base class, so callers can catch everything of ours at once, and subclasses
that also inherit the matching built-in, so generic handlers keep working.
Only the CLI turns these into one-line messages and exit codes.
"""

from __future__ import annotations


class OpdcacheError(Exception):
    """Base class of every error opdcache raises on purpose."""


class ConfigError(OpdcacheError, ValueError):
    """A setting is invalid (the message names the flag or field and the value)."""


class SchemaError(OpdcacheError, ValueError):
    """Data does not match the declared format (wrong column, type, length or version)."""


class ManifestError(OpdcacheError, ValueError):
    """The manifest `opdcache.json` is missing, unreadable or inconsistent."""


class NotACacheError(ManifestError):
    """The path given as a cache is not one (no such folder, a file, a model directory, an empty folder)."""


class ResumeError(OpdcacheError, ValueError):
    """A job was restarted with settings that differ from the partial cache on disk."""


class TokenizerMismatchError(OpdcacheError, ValueError):
    """Two models that must share a tokenizer do not."""


class ConsistencyError(OpdcacheError, ValueError):
    """The scoring teacher is not the teacher pi_ref was fine-tuned from."""


class InputError(OpdcacheError, ValueError):
    """Input data (prompts, a dataset) is malformed."""


class RunFolderError(OpdcacheError, ValueError):
    """A run folder (``--out``) holds what the run did not write: a link, a file too large, a state that breaks its schema."""


class MissingDependencyError(OpdcacheError, ImportError):
    """An optional dependency is needed for the requested feature."""


class InstallError(OpdcacheError, RuntimeError):
    """opdcache's own install lacks a file it ships (a wheel built without its package data, a partial copy)."""


USAGE_ERRORS = (ConfigError, ResumeError, InputError, TokenizerMismatchError, ConsistencyError, MissingDependencyError,
                NotACacheError, RunFolderError)
"""What a command was given that it does not take: exit 2, one line, at any stage that finds it."""
