"""The built-in shop domain: a small, seeded, τ2-retail-like domain for CPU runs."""
from muajax.envs.builtin.confirm import confirm_before_write_rate, is_affirmative, write_confirmations
from muajax.envs.builtin.domain import BuiltinEnvironment, BuiltinSession, WriteRecord
from muajax.envs.builtin.tasks import CHANGE_OF_MIND_KINDS, KINDS
from muajax.envs.builtin.tools import WRITE_TOOLS

__all__ = [
    "BuiltinEnvironment", "BuiltinSession", "WriteRecord", "KINDS", "CHANGE_OF_MIND_KINDS", "WRITE_TOOLS",
    "confirm_before_write_rate", "is_affirmative", "write_confirmations",
]
