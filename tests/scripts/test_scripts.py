"""The tpu/ and gpu/ scripts, checked here rather than on a pod: `bash -n` on each, its
--dry-run with representative settings (which must print its commands, run none and exit
0), and every Python program the printed commands would run, against the installed package.

What runs where: every `python -c` / heredoc program is checked in two ways, its names
resolved (each import, and each attribute read off an imported module, must exist) and run
here in a subprocess. Two need what this machine lacks and run in a reduced form:
tpu/setup.sh's slice check runs as one process (MUAJAX_DISTRIBUTED dropped: there is no
slice to join, so `maybe_initialize_distributed` takes its one-process path) and
tpu/launch.sh's checkpoint-directory check gets a local directory for its gs:// URL (no
bucket, no gcsfs here). Every `python -m muajax.train` gets its arguments parsed and its
config loaded with its overrides, exactly as the workers would; `pip install -e .[extra]`
must name extras that pyproject.toml declares.
"""
from __future__ import annotations

import glob
import os
import re
import shlex
import stat
import subprocess
import sys
import tomllib

import pytest

from tests.support.shell_commands import (
    parse_dry_run,
    python_runs,
    runs_in,
    shell_texts,
    unresolved_names,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "*", "*.sh"))
                 if os.path.basename(os.path.dirname(p)) in ("tpu", "gpu", "scripts"))
SOURCED = {"tpu/common.sh", "scripts/dry_run.sh"}  # sourced by the others, never run
# Commands a dry run must not run: each is replaced by one that records its call and fails.
OUTSIDE = ("gcloud", "gsutil", "ssh", "scp", "srun", "sbatch", "scontrol", "curl", "tar", "uv", "pip",
           "python", "python3", "nohup", "kill", "pkill")
TPU_CONFIG = "configs/runs/qwen3-8b-tau2-v5p.yaml"
GPU_CONFIG = "configs/runs/qwen3-8b-tau2-h100.yaml"
SECRET = "not-a-real-key-4711"
BASE_ENV = {"PROJECT": "my-project", "BUCKET": "my-bucket", "RUN_NAME": "qwen3-8b-tau2-v5p", "HOSTS": "node-a node-b",
            "SECRETS": "OPENAI_API_KEY", "OPENAI_API_KEY": SECRET}
# script: (arguments, extra environment, [programs its commands start with, in order])
CASES = {
    "tpu/create.sh": ([], {}, ["gcloud"] * 3),
    "tpu/delete.sh": ([], {}, ["gcloud"]),
    "tpu/setup.sh": ([], {"MODEL_GCS": "gs://my-bucket/models/Qwen3-8B", "MOUNT_BUCKET": "1"},
                     ["tar", "gcloud", "gcloud", "gcloud", "gcloud", "gcloud", "gcloud", "gcloud"]),
    "tpu/launch.sh": ([TPU_CONFIG, "grpo.steps=2"], {"RESUME": "1"}, ["gcloud"] * 2),
    "tpu/logs.sh": ([], {"FOLLOW": "1", "WORKER": "2"}, ["gcloud"]),
    "tpu/stop.sh": ([], {"PROJECT": ""}, ["gcloud", "gcloud"]),  # no PROJECT: gcloud's default is asked
    "tpu/worker_run.sh": (["run1", "my-bucket", "muajax-venv", "--config", TPU_CONFIG, "run.name=run1"], {},
                          ["curl", "python", "gcloud"]),
    "gpu/launch_nodes.sh": ([GPU_CONFIG, "mesh.fsdp=16"], {}, ["ssh", "ssh"]),
    "gpu/slurm.sh": ([GPU_CONFIG, "mesh.fsdp=16"],
                     {"SLURM_JOB_ID": "4711", "SLURM_JOB_NODELIST": "node-[1-2]", "SLURM_NNODES": "2"},
                     ["scontrol", "srun"]),
    "gpu/stop_nodes.sh": ([], {}, ["ssh", "ssh"]),
}
# Python programs each script's commands run, by kind (a new one must be added here: then
# decide how it can run on this machine, see the module docstring).
EXPECTED = {
    "tpu/setup.sh": {"-c": 1}, "tpu/launch.sh": {"-c": 1, "-m": 1}, "tpu/worker_run.sh": {"-m": 1},
    "gpu/launch_nodes.sh": {"-m": 2}, "gpu/slurm.sh": {"-m": 1},
}
DROPPED_HERE = ("MUAJAX_DISTRIBUTED",)  # no slice to join on this machine


def fake_outside_commands(directory) -> str:
    os.makedirs(directory, exist_ok=True)
    log = os.path.join(directory, "ran.log")
    for name in OUTSIDE:
        path = os.path.join(directory, name)
        with open(path, "w") as f:
            f.write(f'#!/bin/sh\necho "{name} $*" >> {log}\nexit 1\n')
        os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return log


def dry_run(script: str, args, env_extra, tmp_path) -> tuple[subprocess.CompletedProcess, str]:
    bin_dir = tmp_path / "bin"
    log = fake_outside_commands(bin_dir)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path / "home"), "LANG": "C.UTF-8",
           **BASE_ENV, **env_extra}
    env = {k: v for k, v in env.items() if v != ""}
    os.makedirs(env["HOME"], exist_ok=True)
    proc = subprocess.run(["bash", script, "--dry-run", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    ran = ""
    if os.path.exists(log):
        with open(log) as f:
            ran = f.read()
    return proc, ran


def commands_of(script: str, tmp_path) -> list[list[str]]:
    """The commands the script's dry run prints, and those of the scripts they start
    (launch.sh's remote tpu/worker_run.sh), checked to have run nothing."""
    args, env, programs = CASES[script]
    proc, ran = dry_run(script, args, env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert ran == "", f"the dry run of {script} ran: {ran}"
    commands = parse_dry_run(proc.stdout)
    assert [os.path.basename(c[0]) for c in commands] == programs
    assert SECRET not in proc.stdout + proc.stderr
    nested = []
    for command in commands:
        for text in shell_texts(command):
            for words in re.findall(r"tpu/worker_run\.sh ([^>\n]*)", text):
                sub = shlex.split(words)
                sub_proc, sub_ran = dry_run("tpu/worker_run.sh", sub, {}, tmp_path)
                assert sub_proc.returncode == 0 and sub_ran == "", sub_proc.stderr
                nested += parse_dry_run(sub_proc.stdout)
    return commands + nested


def python_of(commands):
    runs = []
    for command in commands:
        runs += python_runs(command[:command.index("<<<")] if "<<<" in command else command)
        for text in shell_texts(command):
            runs += runs_in(text)
    return runs


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_parses(script):
    proc = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_every_script_has_a_dry_run_case():
    assert set(CASES) == set(SCRIPTS) - SOURCED


@pytest.mark.parametrize("script", sorted(CASES))
def test_the_dry_run_prints_its_commands_runs_none_and_exits_0(script, tmp_path):
    commands = commands_of(script, tmp_path)
    runs = python_of(commands)
    counts = {kind: sum(r.kind == kind for r in runs) for kind in ("-c", "-m")}
    assert {k: v for k, v in counts.items() if v} == EXPECTED.get(script, {})


def programs_of(script, tmp_path):
    return [r for r in python_of(commands_of(script, tmp_path)) if r.kind == "-c"]


@pytest.mark.parametrize("script", [s for s, kinds in EXPECTED.items() if "-c" in kinds])
def test_every_python_program_the_scripts_run_resolves_and_runs_here(script, tmp_path):
    for run in programs_of(script, tmp_path):
        assert unresolved_names(run.code) == [], f"{script} runs Python that names what the package lacks"
        env = {k: v for k, v in {**os.environ, **run.env}.items() if k not in DROPPED_HERE}
        args = [str(tmp_path / "ckpt" / a[len("gs://"):]) if a.startswith("gs://") else a for a in run.args]
        proc = subprocess.run([sys.executable, "-c", run.code, *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300, check=False)
        assert proc.returncode == 0, f"{script}'s program failed here:\n{run.code}\n{proc.stderr[-3000:]}"
        if "maybe_initialize_distributed" in run.code:
            assert re.search(r"worker 0/1: \d+ of \d+ devices", proc.stdout), proc.stdout


@pytest.mark.parametrize("script", [s for s, kinds in EXPECTED.items() if "-m" in kinds])
def test_every_training_command_names_a_module_and_a_config_that_load(script, tmp_path):
    from muajax.config.schema import load_config
    from muajax.train.__main__ import parse_args

    runs = [r for r in python_of(commands_of(script, tmp_path)) if r.kind == "-m"]
    assert runs
    for run in runs:
        assert run.code == "muajax.train"
        args = parse_args(run.args)
        cfg = load_config(args.config, args.overrides)
        assert os.path.isfile(os.path.join(ROOT, args.config))
        if script == "tpu/launch.sh":  # every worker writes its shards to the bucket; RESUME=1 resumes
            assert cfg.checkpoint.dir == "gs://my-bucket/qwen3-8b-tau2-v5p/checkpoints" and args.resume == "required"


def test_pip_installs_name_extras_that_exist(tmp_path):
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = set(tomllib.load(f)["project"]["optional-dependencies"])
    named = []
    for command in commands_of("tpu/setup.sh", tmp_path):
        for text in shell_texts(command):
            named += re.findall(r"pip install[^\n]*?-e \S+?'?\[([\w,-]+)\]", text)
    assert named == ["tpu"] and set(",".join(named).split(",")) <= extras


def test_the_reader_finds_heredocs_and_inline_programs_and_names_what_is_missing():
    text = ("cd ~/muajax && FLAG=1 ~/venv/bin/python - <<'EOF'\n"
            "from muajax.runtime.distributed import maybe_initialize_distributed, no_such_function\n"
            "EOF\n"
            "echo done; python3 -u -c 'import jax; jax.process_index(); jax.no_such_attribute' first 2>&1 | tee log\n"
            "exec \"$PYTHON\" -m muajax.train --config c.yaml > out")
    heredoc, inline, module = runs_in(text)
    assert (heredoc.kind, heredoc.env, heredoc.args) == ("-c", {"FLAG": "1"}, [])
    assert (inline.kind, inline.args) == ("-c", ["first"])
    assert (module.kind, module.code, module.args) == ("-m", "muajax.train", ["--config", "c.yaml"])
    assert unresolved_names(heredoc.code) == [
        "from muajax.runtime.distributed import no_such_function: muajax.runtime.distributed has no no_such_function"]
    assert unresolved_names(inline.code) == ["jax.no_such_attribute: no such attribute"]
    assert unresolved_names("from muajax.train.build import maybe_initialize_distributed") != []
