"""The built-in shop domain: a small, seeded, τ2-retail-like domain for CPU runs."""
from muajax.domains.builtin.confirm import is_affirmative, write_confirmations
from muajax.domains.builtin.domain import BuiltinEnvironment, BuiltinSession, WriteRecord
from muajax.domains.builtin.tasks import CHANGE_OF_MIND_KINDS, KINDS
from muajax.domains.builtin.tools import WRITE_TOOLS

__all__ = [
    "BuiltinEnvironment", "BuiltinSession", "WriteRecord", "KINDS", "CHANGE_OF_MIND_KINDS", "WRITE_TOOLS",
    "is_affirmative", "write_confirmations",
]
