"""Every command the README shows runs as a newcomer would type it, with tiny step counts.

Commands are read from the README itself: fenced ``bash`` blocks and inline `merak-train …`,
`python …` and `make …` in the prose. Each has an entry in :data:`CASES` saying what it must
produce; a README command without an entry fails :func:`test_every_readme_command_has_a_case`,
so no command lands untested. Hydra commands keep their process counts; step counts, data
size and validation are made tiny, and the output directory is the test's. Python blocks are
complete programs: each runs as written (under ``torchrun`` when its first line says so),
with its step counts made tiny by substitutions that must each match.

Runs are the suite's slowest part, so none is repeated: commands that come down to the same
argument vector share one run (``make train`` and its variants run exactly the ``merak-train``
command, checked by ``make -n``; a command's ``before`` is the other case's run), and the
benchmarks' ``--help`` run in one interpreter, which imports torch and Lightning once.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent
SHELL_PROGRAMS = ("merak-train", "python", "make", "torchrun", "srun")
TINY_OVERRIDES = {
    "trainer.max_steps": "2",
    "trainer.val_check_interval": "2",
    "trainer.limit_val_batches": "1",
    "trainer.log_every_n_steps": "1",
    "data.num_sequences": "128",
}


def readme_commands() -> list[str]:
    """Shell commands of the README, in order, without comments or line continuations."""
    commands: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split("  #")[0].split(" # ")[0].strip()
            if command and not command.startswith("#"):
                commands.append(" ".join(command.split()))
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    for command in re.findall(r"`((?:%s)\b[^`]*)`" % "|".join(SHELL_PROGRAMS), prose):
        if command not in ("make", "python"):  # the tools named, not commands
            commands.append(" ".join(command.split()))
    return list(dict.fromkeys(commands))


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


@dataclass(frozen=True)
class Case:
    """What a README command must do here.

    ``trains``: a finished merak-train run (exit 0, its "done" line, one final checkpoint,
    losses in metrics.csv, TensorBoard events). ``output``: substrings of its output.
    ``files``: globs under the run's output directory. ``not_run``: why the command cannot
    run on this machine; such a command is checked by ``substitute`` instead, a command
    that exercises the same path here. ``before``: a README command that must run first
    (it makes the files this one reads). ``config_only``: the command, as the README writes it,
    goes only as far as its composed configuration (Hydra's ``--cfg job``: composed and checked
    against the schemas, nothing trained), which ``output`` and ``same_config_as`` (a README
    command whose composed configuration it must equal) check; for a command whose training
    would repeat what other tests run (the case names them).
    """

    trains: bool = True
    output: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    timeout: float = 300
    not_run: str = ""
    substitute: str = ""
    before: str = ""
    config_only: bool = False
    same_config_as: str = ""


CASES: dict[str, Case] = {
    "make train": Case(),
    "make test": Case(trains=False, not_run="it is the command that runs this suite"),
    "make lock": Case(trains=False, not_run="re-resolves and reinstalls every dependency, then runs the suite",
                      substitute="make -n lock"),
    "make train TORCH=torch==2.13.0": Case(
        not_run="installs torch's CUDA build for a CUDA machine (several GB)", substitute="make train"),
    'make train ARGS="trainer.max_steps=50"': Case(),
    "merak-train": Case(output=("loss floor (entropy rate)",)),
    "merak-train --help": Case(trains=False, output=("== Configuration groups ==", "strategy:", "comm:")),
    # trains as `merak-train` does (that case runs it) with other numbers: its overrides must land
    "merak-train trainer.max_steps=1000 data.batch_size=32": Case(
        trains=False, config_only=True, output=("  batch_size: 32\n", "  max_steps: 1000\n")),
    "merak-train model=gpt2_tiny": Case(),
    "merak-train model=hf model.model_type=mistral +model.config.hidden_size=128 "
    "+model.config.num_hidden_layers=2": Case(),
    "merak-train data=text data.path=/abs/path/corpus.jsonl data.text_field=text": Case(),
    "merak-train data=text data.path=/abs/corpus.txt data.tokenizer_path=/abs/tokenizer_dir": Case(),
    # the same app as merak-train; `python -m lightning_merak.cli.train` trains (Lightning relaunching it for
    # rank 1) in test_merak3d_first_batch's and test_termination's merak-train runs, and under torchrun below
    "python -m lightning_merak.cli.train ...": Case(trains=False, config_only=True, same_config_as="merak-train"),
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29400 -m "
    "lightning_merak.cli.train trainer=gpu trainer.num_nodes=2 trainer.devices=8": Case(
        not_run="needs two hosts with 8 GPUs each",
        substitute="torchrun --standalone --nproc-per-node 2 -m lightning_merak.cli.train trainer.devices=2"),
    "srun python -m lightning_merak.cli.train trainer=gpu trainer.num_nodes=2 trainer.devices=8": Case(
        not_run="needs a SLURM cluster with GPUs",
        substitute="torchrun --standalone --nproc-per-node 2 -m lightning_merak.cli.train trainer.devices=2"),
    "merak-train strategy.pipeline_parallel=2 strategy.micro_batches=4": Case(
        output=("pipeline_parallel=2",)),
    "merak-train trainer.devices=4 strategy.pipeline_parallel=2 strategy.tensor_parallel=2": Case(
        output=("pipeline_parallel=2 tensor_parallel=2",)),
    "merak-train data.lengths=variable data.max_length=512 strategy.pipeline_parallel=2 "
    "strategy.micro_batching=dynamic": Case(output=("pipeline_parallel=2",)),
    "merak-train strategy.tensor_parallel=2 strategy.sequence_parallel=true": Case(
        output=("tensor_parallel=2", "sequence_parallel=True")),
    "merak-train strategy.tensor_parallel=auto strategy.pipeline_parallel=auto strategy.tp_overlap=auto "
    "strategy.plan_only=true": Case(trains=False, output=("plan only, nothing trained. Planned layout",),
                                    timeout=600),
    "merak-train memory=delta memory.budget=2GiB": Case(files=("**/delta_memory_timeline.png",)),
    "merak-train strategy=ddp comm=s2": Case(),
    "merak-train model=mixtral_tiny moe=prophet": Case(files=("csv/moe_load_heatmap.png",)),  # in the log dir
    "merak-train model=mixtral_tiny moe=deepspeed": Case(),
    "merak-train model=mixtral_tiny moe=shadowing moe.ep_size=2": Case(),
    "merak-train model=mixtral_tiny strategy=ddp moe=prophet moe.experts=merak_ep moe.ep_size=2": Case(),
    "merak-train model=mixtral_tiny strategy=ddp moe=prophet moe.experts=merak_ep moe.ep_size=2 adapter=lora "
    "adapter.experts=true adapter.quantization=none": Case(
        trains=False, config_only=True, output=("  experts: true\n", "  experts: merak_ep\n")),
    # trained by tests/test_moe_adapters_options.py (the options) and tests/test_moe_adapters_merak3d.py (DDP runs)
    "merak-train adapter=qbara adapter.r=8 adapter.quantization=nf4": Case(),
    "merak-train model=hf model.path=/abs/checkpoint_dir strategy.pipeline_parallel=2": Case(),
    "merak-train model=hf model.path=/abs/checkpoint_dir adapter=qbara adapter.quantization=nf4 "
    "strategy.pipeline_parallel=2": Case(output=("pipeline_parallel=2",)),
    "merak-export /abs/run_dir/checkpoints/final.ckpt /abs/exported_dir": Case(
        trains=False, output=("merak-export: wrote",),
        before="merak-train model=hf model.path=/abs/checkpoint_dir strategy.pipeline_parallel=2"),
    "python examples/finetune_adapter.py [--method qbara]": Case(trains=False, output=("NF4 merge re-quantizes",)),
}
# Benchmarks are measurements that take minutes each (some need root for the emulated network);
# here each must parse its arguments. Their figures live in benchmarks/results.
BENCHMARK = re.compile(
    r"^python -m benchmarks\.(\w+|<name>)( \[--quick\]| --quick)?( \[--device cuda\]| --device cuda)?$")


# Where a command's README placeholders point, under the directory it runs in.
PLACEHOLDERS = {"/abs/path/corpus.jsonl": "corpus.jsonl", "/abs/corpus.txt": "corpus.txt",
                "/abs/tokenizer_dir": "tokenizer", "/abs/checkpoint_dir": "checkpoint", "/abs/run_dir": "run",
                "/abs/exported_dir": "exported"}
CORPUS = ("corpus.jsonl", "corpus.txt", "tokenizer")
# Stands for the directory a command runs in: argument vectors are compared (and runs shared)
# with it, and it is replaced by a fresh directory when the command runs.
RUN_DIRECTORY = Path("/readme-run")


def _write_corpus(directory: Path) -> None:
    """A text corpus, the same as JSONL, and a local tokenizer trained on it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
    lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(40)) for i in range(200)]
    text = directory / "corpus.txt"
    text.write_text("\n".join(lines))
    jsonl = directory / "corpus.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": line}) for line in lines))
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train([str(text)], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tokenizer_dir = directory / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="</s>").save_pretrained(
        tokenizer_dir)


def _write_inputs(argv: list[str], directory: Path) -> None:
    """Make real the placeholder inputs (corpus, tokenizer, checkpoint) that ``argv`` reads from ``directory``."""
    words = " ".join(argv)
    if any(str(RUN_DIRECTORY / name) in words for name in CORPUS):
        _write_corpus(directory)
    if str(RUN_DIRECTORY / PLACEHOLDERS["/abs/checkpoint_dir"]) in words:
        _write_checkpoint(directory / PLACEHOLDERS["/abs/checkpoint_dir"])


def _write_checkpoint(directory: Path) -> Path:
    """A small pretrained-style transformers directory (Llama, random weights) whose vocabulary fits the data."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if not directory.exists():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def _tiny(overrides: list[str], run_dir: Path) -> list[str]:
    """The README's Hydra overrides with tiny step counts and this test's output directory."""
    values = {key: f"{key}={value}" for key, value in TINY_OVERRIDES.items()}
    kept = []
    for override in overrides:
        key = override.lstrip("+").split("=", 1)[0]
        if key in values:
            continue
        kept.append(override)
    return [*kept, *values.values(), f"hydra.run.dir={run_dir}"]


def _argv(command: str, tmp_path: Path = RUN_DIRECTORY, tiny: bool = True) -> list[str]:
    """The argument vector that runs a README command here (with tiny step counts unless ``tiny`` is false)."""
    for placeholder, name in PLACEHOLDERS.items():
        command = command.replace(placeholder, str(tmp_path / name))
    words = [word for word in shlex.split(command) if word not in ("...", "[--method", "qbara]")]
    if command.endswith("[--method qbara]"):
        words += ["--method", "qbara"]
    run_dir = tmp_path / "run"
    program = words[0]
    if program == "make":
        args = [word.split("=", 1)[1] for word in words if word.startswith("ARGS=")]
        rest = [word for word in words[1:] if not word.startswith("ARGS=")]
        tiny = _tiny(shlex.split(args[0]) if args else [], run_dir)
        return ["make", "--no-print-directory", "-C", str(ROOT), "VENV=" + str(BIN.parent), *rest,
                "ARGS=" + shlex.join(tiny)]
    if program in ("merak-train", "merak-export"):
        words[0] = str(BIN / program)
    elif program == "torchrun":
        words[0] = str(BIN / "torchrun")
    elif program == "python":
        words[0] = sys.executable
    if program == "python" and words[1].endswith(".py"):
        return [words[0], str(ROOT / words[1]), *words[2:], "--steps", "2", "--out", str(tmp_path / "out")]
    if "--help" in words or program == "merak-export" or not tiny:
        return words
    module_at = words.index("-m") + 2 if "-m" in words else 1
    return [*words[:module_at], *_tiny(words[module_at:], run_dir)]


# Noise a run must not print: a dependency's optional-kernel notice, checkpoints overwritten,
# modules left in eval mode by the layout build, informational lines repeated by other ranks.
NOISE = ("Failed to load CPU gemm_4bit_forward", "overwriting", "module(s) in eval mode", "[rank: 1]",
         "weights_only` was not set", "Setting accelerator to CPU")


def _check_trained(stdout: str, output: str, run_dir: Path) -> None:
    noise = [line for line in output.splitlines() if any(pattern in line for pattern in NOISE)]
    assert not noise, f"the run printed noise: {noise}"
    last_line = stdout.strip().splitlines()[-1]
    assert last_line.startswith("merak-train: done. Outputs in"), last_line
    checkpoints = sorted(path.name for path in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["final.ckpt"], f"one final checkpoint expected, found {checkpoints}"
    with (run_dir / "csv" / "metrics.csv").open() as metrics:
        losses = [float(row["train/loss"]) for row in csv.DictReader(metrics) if row.get("train/loss")]
    assert len(losses) == int(TINY_OVERRIDES["trainer.max_steps"]), losses
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


@dataclass(frozen=True)
class Run:
    """A finished command: its exit status, its output, and the directory it ran in."""

    returncode: int
    stdout: str
    stderr: str
    directory: Path


def _run(argv: list[str], directory: Path, timeout: float) -> Run:
    """Run ``argv`` in ``directory``, its inputs written first; past ``timeout``, end its ranks too and fail."""
    _write_inputs(argv, directory)
    argv = [word.replace(str(RUN_DIRECTORY), str(directory)) for word in argv]
    process = subprocess.Popen(argv, cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{shlex.join(argv)} did not finish within {timeout:.0f}s:\n{(stdout + stderr)[-4000:]}")
    return Run(process.returncode, stdout, stderr, directory)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Run]:
    """Runs each distinct argument vector once, in a directory of its own unless given one; repeats share it."""
    done: dict[tuple[str, ...], Run] = {}

    def run(argv: list[str], timeout: float, directory: Path | None = None) -> Run:
        key = tuple(argv)
        if key not in done:
            done[key] = _run(argv, directory or tmp_path_factory.mktemp("readme"), timeout)
        return done[key]

    return run


def _make_recipe(argv: list[str]) -> list[str]:
    """The one command ``make`` runs for ``argv`` (read with ``make -n``), split into its arguments."""
    dry = subprocess.run([argv[0], "-n", *argv[1:]], capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    commands = dry.stdout.splitlines()
    assert len(commands) == 1, f"{shlex.join(argv)} would run more than one command (make setup first?): {commands}"
    return shlex.split(commands[0])


def test_every_readme_command_has_a_case() -> None:
    commands = [command for command in readme_commands() if not BENCHMARK.match(command)]
    missing = [command for command in commands if command not in CASES]
    stale = [command for command in CASES if command not in commands]
    assert not missing, f"README commands without a test case: {missing}"
    assert not stale, f"test cases for commands the README no longer shows: {stale}"


@pytest.mark.parametrize("command", list(CASES))
def test_readme_command(command: str, runs: Callable[..., Run]) -> None:
    case = CASES[command]
    if case.not_run:
        if not case.substitute:
            pytest.skip(f"not run here: {case.not_run}")
        command = case.substitute
    argv = _argv(command)
    if case.config_only:
        argv = [*_argv(command, tiny=False), "--cfg", "job"]
    if argv[0] == "make" and "train" in argv:
        # `make train` runs merak-train with ARGS and nothing else; that merak-train run is the `merak-train` case's
        recipe = _make_recipe(argv)
        assert recipe == [str(BIN / "merak-train"), *shlex.split(argv[-1].removeprefix("ARGS="))], recipe
        argv = recipe
    directory = None
    if case.before:
        first = runs(_argv(case.before), CASES[case.before].timeout)
        assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
        directory = first.directory
    run = runs(argv, case.timeout, directory)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    if case.same_config_as:
        other = runs([*_argv(case.same_config_as, tiny=False), "--cfg", "job"], case.timeout)
        assert other.returncode == 0, (other.stdout + other.stderr)[-4000:]
        assert run.stdout == other.stdout, f"{command!r} composes another configuration than {case.same_config_as!r}"
    for expected in case.output:
        assert expected in output, f"{expected!r} not in the output of {command!r}:\n{output[-3000:]}"
    run_dir = run.directory / "run"
    for pattern in case.files:
        assert list(run_dir.glob(pattern)), f"{command!r} wrote no {pattern} under {run_dir}"
    if case.trains:
        _check_trained(run.stdout, output, run_dir)


BENCHMARKS = sorted({m.group(1) for c in readme_commands() if (m := BENCHMARK.match(c))} - {"<name>"})
# `python -m benchmarks.<name> --help` for each name given, in one interpreter: each module runs as
# __main__ with its own argv; prints {name: [exit status, output]} as JSON on its last line.
HELP_EACH = """
import contextlib, io, json, runpy, sys, traceback
outputs = {}
for name in sys.argv[1:]:
    sys.argv = ["benchmarks." + name, "--help"]
    buffer, status = io.StringIO(), 0
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            runpy.run_module("benchmarks." + name, run_name="__main__", alter_sys=True)
        except SystemExit as exit_:
            status = exit_.code or 0
        except Exception:
            status = 1
            buffer.write(traceback.format_exc())
    outputs[name] = [status, buffer.getvalue()]
print(json.dumps(outputs))
"""


@pytest.fixture(scope="module")
def benchmark_help() -> dict[str, list]:
    result = subprocess.run([sys.executable, "-c", HELP_EACH, *BENCHMARKS], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", BENCHMARKS)
def test_readme_benchmark_parses_its_arguments(name: str, benchmark_help: dict[str, list]) -> None:
    status, output = benchmark_help[name]
    assert status == 0 and "--quick" in output, output


def test_help_imports_no_torch() -> None:
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "lightning_merak.cli.train", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    heavy = sorted(imported & {"torch", "lightning", "transformers", "deepspeed", "bitsandbytes", "peft"})
    assert not heavy, f"merak-train --help imports {heavy}"


# Python blocks: a line that identifies each, the substitutions that make it tiny, and what
# it must print.
PYTHON_CASES: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    'strategy="ddp", max_steps=300': ({"max_steps=300": "max_steps=3"}, ()),
    "Merak3DStrategy(data_parallel=1": ({"max_steps=100": "max_steps=2"}, ()),
    "DeltaMemory(budget=": ({"max_steps=50": "max_steps=4"}, ("DeltaMemory: memory timeline saved to",)),
    'SparseCommunication("s2"': ({"max_steps=50": "max_steps=3"}, ()),
    "from lightning_merak.plugins.moe import MoE": ({}, ("tokens per expert",)),
    "from peft import get_peft_model": ({"range(20)": "range(2)"}, ()),
    "from lightning_merak.testing.netem import": ({}, ("['joined', 'joined']",)),
    "from lightning_merak.plugins.moe.experts import enable_expert_parallel": (
        {}, ("rank 1 holds experts [4, 5, 6, 7]",)),
}


def _python_block_case(block: str) -> str:
    keys = [key for key in PYTHON_CASES if key in block]
    assert len(keys) == 1, f"a README Python block matches {len(keys)} cases:\n{block[:400]}"
    return keys[0]


def test_every_readme_python_block_has_a_case() -> None:
    for block in readme_python_blocks():
        _python_block_case(block)


@pytest.mark.parametrize("index", range(len(readme_python_blocks())))
def test_readme_python_block(index: int, tmp_path: Path) -> None:
    block = readme_python_blocks()[index]
    substitutions, expected_output = PYTHON_CASES[_python_block_case(block)]
    for old, new in substitutions.items():
        assert old in block, f"substitution {old!r} no longer matches the block"
        block = block.replace(old, new)
    script = tmp_path / "block.py"
    script.write_text(block)
    first_line = block.splitlines()[0]
    if first_line.startswith("# torchrun "):
        argv = [str(BIN / "torchrun"), *shlex.split(first_line[2:])[1:-1], str(script)]
    else:
        argv = [sys.executable, str(script)]
    result = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for expected in expected_output:
        assert expected in output, f"{expected!r} not in the block's output:\n{output[-3000:]}"
