"""`run.gpu_memory_fraction`: the trainer sets the share of each GPU jax may take before jax's
GPU client starts, unless the user set it; it says so on GPU only."""
import os
import subprocess
import sys

import pytest

from muajax.config.schema import ConfigError, load_config
from muajax.train import gpu_memory
from muajax.train.__main__ import EMBEDDED_DEFAULT
from muajax.train.gpu_memory import OLD_VARIABLE, VARIABLE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_configs_fraction_is_set_when_the_environment_names_none():
    environ = {"PATH": "/bin"}
    setting = gpu_memory.apply(0.9, environ)
    assert environ == {"PATH": "/bin", VARIABLE: "0.9"} and not setting.from_environment
    assert setting.line == (f"muajax.train: GPU memory: set {VARIABLE}=0.9 (run.gpu_memory_fraction): "
                            "jax may take 90% of each GPU")


@pytest.mark.parametrize("name", [VARIABLE, OLD_VARIABLE])
def test_the_users_variable_wins_under_either_name(name):
    # jax refuses both names at once: with the old one set, the new one must stay unset
    environ = {name: ".5"}
    setting = gpu_memory.apply(0.9, environ)
    assert environ == {name: ".5"} and setting.from_environment and setting.variable == name
    assert setting.line == (f"muajax.train: GPU memory: {name}=.5 from the environment wins over "
                            "run.gpu_memory_fraction=0.9: jax may take 50% of each GPU")


def test_an_empty_variable_counts_as_unset_as_jax_reads_it():
    environ = {OLD_VARIABLE: ""}
    assert not gpu_memory.apply(0.8, environ).from_environment and environ[VARIABLE] == "0.8"


def test_the_line_is_printed_on_gpu_only(capsys):
    setting = gpu_memory.decide(0.9, {})
    gpu_memory.announce(setting, "cpu")
    gpu_memory.announce(setting, "tpu")
    assert capsys.readouterr().out == ""
    gpu_memory.announce(setting, "gpu")
    assert capsys.readouterr().out == setting.line + "\n"


@pytest.mark.parametrize("value", ["0", "-0.1", "1.5"])
def test_the_fraction_is_a_share_of_the_card(value):
    with pytest.raises(ConfigError, match="gpu_memory_fraction"):
        load_config(EMBEDDED_DEFAULT, [f"run.gpu_memory_fraction={value}"])
    assert load_config(EMBEDDED_DEFAULT).run.gpu_memory_fraction == 0.9


# The trainer's entry point, up to the first device query: whether jax's client had started when
# the variable was set, and what jax will read. Trainer is replaced: nothing runs.
ENTRY = """
import os, jax
from jax._src import xla_bridge
import muajax.train.__main__ as entry
from muajax.config.schema import ConfigError

def record():
    print("SEEN", os.environ.get("{variable}"), xla_bridge.backends_are_initialized())

class Stop:
    def __init__(self, *args, **kwargs):
        raise ConfigError("stopped before training")

entry.maybe_initialize_distributed = record
entry.Trainer = Stop
jax.default_backend = lambda: "gpu"   # as on a GPU host: the line is printed
raise SystemExit(entry.main(["run.gpu_memory_fraction=0.6"]))
"""


def test_the_trainer_sets_it_before_jax_starts():
    env = {k: v for k, v in os.environ.items() if k not in (VARIABLE, OLD_VARIABLE)}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", ENTRY.replace("{variable}", VARIABLE)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2 and "stopped before training" in proc.stderr, proc.stderr[-2000:]
    assert "SEEN 0.6 False" in proc.stdout  # set, and jax had not created a backend yet
    assert f"muajax.train: GPU memory: set {VARIABLE}=0.6 (run.gpu_memory_fraction)" in proc.stdout
