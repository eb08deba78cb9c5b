"""Every example of the README runs as written, in the order written, on a fresh demo, and ends.

The README's ```sh and ```python blocks are what a newcomer types or saves while
`./scripts/demo` runs, and they drifted from the product (a channel nothing created, a wait on
a channel nothing published to, placeholders for an id and a receipt). This test starts a fresh
demo with its traffic, as the README's first command does, in a temporary working directory
(`--data-dir data/local` there, so that the README's relative paths name the test's own demo),
then runs every sh line through `bash -e` and every python block as a script, in order, each
with a timeout, and fails at the first that exits non-zero, showing the block and its output.
A sh line that starts a demo (the second cluster of the forward example) is started the same
way in the background, on free ports instead of the README's.

A block is run unless SKIPPED names it, by its first line or the heading above it, and says why:
a new block is run by default. Blocks of any other language (text, the diagrams) are not code.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from qserver.dev.devcluster import REPOSITORY, TEST_TLS_CA_ENV, TEST_TLS_ENV, free_port, port_free

README = REPOSITORY / "README.md"
RUN_LANGUAGES = ("sh", "python")
TEST_BUDGET_S = 150.0           # the whole test, demos included (pytest's timeout below is the backstop)
STEP_TIMEOUT_S = 60.0           # one sh line, one python block, one demo's start
DEMO_STOP_TIMEOUT_S = 30.0      # Ctrl-C: the demo stops its nodes one at a time
OUTPUT_SHOWN_CHARS = 4000
DEMO_COMMAND = "./scripts/demo"
# The README's demo runs in plaintext on loopback; the suite's TLS switch is for its own clusters.
SUITE_ONLY_ENV = (TEST_TLS_ENV, TEST_TLS_CA_ENV)
EXPORT_LINE = re.compile(r"^from any directory: export QSERVER_CREDENTIALS=(\S+)$", re.MULTILINE)
# A demo is ready for the README's commands once its live view has printed (its queues exist
# then), or, with --no-demo, once it says the cluster runs.
DEMO_READY = re.compile(r"^(\d\d:\d\d:\d\d produced |cluster running; Ctrl-C stops it)", re.MULTILINE)


@dataclass(frozen=True)
class Skip:
    """A block that is not an example to run against the demo: matched by the start of its
    first line, or by the heading of its section."""
    reason: str
    first_line: str = ""
    heading: str = ""

    def matches(self, block: Block) -> bool:
        if self.first_line:
            return block.first_line.startswith(self.first_line)
        return block.heading == self.heading


SKIPPED = (
    Skip("the two commands: the test starts the demo itself, and ./scripts/test is the whole suite",
         first_line="./scripts/demo     # the main job"),
    Skip("a cluster by hand on machines of its own (10.0.0.1, deploy/node.toml), not the demo",
         first_line=".venv/bin/qserver init --data-dir data/n1 --node-id n1"),
    Skip("a node by hand: `qserver run` serves until stopped, on the demo's port, and `qserver init` "
         "writes to ~/.config/qserver", heading="Running a node by hand"),
    Skip("a Celery worker serves until stopped (tests/test_celery.py runs a real worker through a cluster)",
         first_line=".venv/bin/celery -A tasks worker"),
    Skip("an upgrade, with a stop and an install between its lines (tests/test_node_drain.py runs the "
         "drain and undrain, tests/test_upgrade.py the whole roll and the finalize)",
         heading="Upgrading: one node at a time, then finalize"),
)


@dataclass(frozen=True)
class Block:
    language: str
    text: str
    heading: str
    line_number: int            # of the opening fence in README.md

    @property
    def first_line(self) -> str:
        return self.text.split("\n", 1)[0]

    def where(self) -> str:
        return f"README.md line {self.line_number} ({self.heading or 'the introduction'})"


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks in order, each with the heading of its section."""
    blocks: list[Block] = []
    lines: list[str] = []                          # of the open block
    opened: tuple[str, int] | None = None          # (language, line number) of its fence
    heading = ""
    for number, line in enumerate(text.splitlines(), 1):
        if opened is not None:
            if line.startswith("```"):
                blocks.append(Block(opened[0], "\n".join(lines), heading, opened[1]))
                opened, lines = None, []
            else:
                lines.append(line)
        elif line.startswith("```"):
            opened = (line[3:].strip(), number)
        elif line.startswith("#"):
            heading = line.lstrip("#").strip()
    return blocks


def skip_of(block: Block) -> Skip | None:
    return next((skip for skip in SKIPPED if skip.matches(block)), None)


def examples() -> list[Block]:
    return [block for block in readme_blocks(README.read_text())
            if block.language in RUN_LANGUAGES and skip_of(block) is None]


def commands(block: Block) -> list[str]:
    """A sh block's commands, one a line; a line that holds only a comment continues the one above."""
    return [line for line in block.text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


# --- processes ------------------------------------------------------------------------------------
class Budget:
    """The time left for the whole test: each step waits at most its own cap and what is left."""

    def __init__(self, total_s: float) -> None:
        self.deadline = time.monotonic() + total_s

    def step_s(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"the README's examples took more than {TEST_BUDGET_S:g} s in all")
        return min(STEP_TIMEOUT_S, left)


@dataclass
class Ran:
    code: int | None            # None: it was still running at its timeout (its process group was killed)
    output: str


def run(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> Ran:
    """Run one command in a process group of its own, so that a timeout ends it with whatever it
    started (a qctl under bash)."""
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
        return Ran(process.returncode, output)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return Ran(None, output)


@dataclass
class Demo:
    """A `python -m qserver.dev.local` the test started: its own process group (its nodes are in
    sessions of their own, which its Ctrl-C stops one at a time)."""
    process: subprocess.Popen[bytes]
    output_path: Path

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
        try:
            self.process.wait(timeout=DEMO_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@contextlib.contextmanager
def ctrl_c_not_ignored() -> Iterator[None]:
    """Ctrl-C (SIGINT) is how a demo stops. A shell that ran this test in the background, without
    job control, left SIGINT ignored, which a child inherits: the demo would never stop on it.
    Handled here while the child starts, it starts with the default."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def start_demo(arguments: list[str], cwd: Path, env: dict[str, str], name: str, budget: Budget) -> Demo:
    output_path = cwd / f"{name}.out"
    with open(output_path, "wb") as output, ctrl_c_not_ignored():
        process = subprocess.Popen([sys.executable, "-m", "qserver.dev.local", *arguments], cwd=cwd, env=env,
                                   stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    demo = Demo(process, output_path)
    deadline = time.monotonic() + budget.step_s()
    while not DEMO_READY.search(demo.output()):
        if process.poll() is not None or time.monotonic() > deadline:
            state = f"exited with {process.returncode}" if process.poll() is not None else "not ready in time"
            demo.stop()
            pytest.fail(f"the demo {shlex.join(arguments)} {state}:\n{demo.output()[-OUTPUT_SHOWN_CHARS:]}",
                        pytrace=False)
        time.sleep(0.1)
    return demo


def processes_naming(text: str) -> list[int]:
    """The pids of the processes whose command line holds `text` (the test's own directory:
    only the nodes of its demos can)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command_line = (entry / "cmdline").read_bytes()
        except OSError:         # it exited meanwhile
            continue
        if text.encode() in command_line:
            found.append(int(entry.name))
    return found


def end_leftovers(directory: Path) -> list[int]:
    """Kill (by pid) any node of the test's demos still running after the demos stopped, wait
    until none is left, and return the pids that were found."""
    leftovers = processes_naming(str(directory))
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while processes_naming(str(directory)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return leftovers




def free_base_port(taken: set[int]) -> int:
    """A --base-port whose six ports (base+1..3 for clients, base+101..103 for membership) are free
    and not given to another demo of this test."""
    for _ in range(200):
        base = free_port() - 1
        ports = {base + offset for offset in (1, 2, 3, 101, 102, 103)}
        if not ports & taken and all(port_free(port) for port in ports):
            taken.update(ports)
            return base
    raise RuntimeError("no free block of ports for a demo")


def demo_arguments(line: str, taken_ports: set[int]) -> list[str]:
    """The arguments of a README line that starts a demo, on free ports instead of its own."""
    words = shlex.split(line, comments=True)
    assert words[0] == DEMO_COMMAND, line
    arguments = words[1:]
    base = str(free_base_port(taken_ports))
    if "--base-port" in arguments:
        arguments[arguments.index("--base-port") + 1] = base
    else:
        arguments += ["--base-port", base]
    return arguments


# --- the test ---------------------------------------------------------------------------------------
def failure(block: Block, what: str, ran: Ran, demo: Demo) -> str:
    verdict = "did not end in time" if ran.code is None else f"exited with {ran.code}"
    return (f"{block.where()}: {what} {verdict}\n\n--- the block ---\n{block.text}\n\n--- its output ---\n"
            f"{ran.output[-OUTPUT_SHOWN_CHARS:]}\n--- the demo's last lines ---\n"
            + "\n".join(demo.output().splitlines()[-15:]))


def test_the_skip_list_names_blocks_the_readme_has() -> None:
    blocks = readme_blocks(README.read_text())
    for skip in SKIPPED:
        assert [block for block in blocks if skip.matches(block)], f"no README block is skipped by {skip}"
    assert examples(), "no example found in README.md"


@pytest.mark.timeout(TEST_BUDGET_S + 60)
def test_readme_examples_run_as_written_on_a_fresh_demo(tmp_path: Path) -> None:
    budget = Budget(TEST_BUDGET_S)
    (tmp_path / ".venv").symlink_to(REPOSITORY / ".venv")     # the README's .venv/bin/qctl, from here
    env = {key: value for key, value in os.environ.items() if key not in SUITE_ONLY_ENV}
    env["PYTHONPATH"] = str(REPOSITORY)
    taken_ports: set[int] = set()
    demos: list[Demo] = []
    try:
        demos.append(start_demo(["--data-dir", "data/local", "--base-port", str(free_base_port(taken_ports)),
                                 "--credentials", str(tmp_path / "creds.json")], tmp_path, env, "demo", budget))
        exported = EXPORT_LINE.search(demos[0].output())
        assert exported, f"the demo printed no export line:\n{demos[0].output()}"
        assert Path(exported.group(1)).is_file(), exported.group(0)
        # What the README tells a user outside the repository root to do: the printed export.
        env["QSERVER_CREDENTIALS"] = exported.group(1)
        for block in examples():
            run_example(block, tmp_path, env, demos, taken_ports, budget)
    finally:
        for demo in reversed(demos):
            demo.stop()
        leftovers = end_leftovers(tmp_path)
    assert not leftovers, f"the demos left processes running (killed now): {leftovers}"
    for demo in demos:
        assert demo.process.returncode == 0, f"a demo did not stop on Ctrl-C:\n{demo.output()[-OUTPUT_SHOWN_CHARS:]}"


def run_example(block: Block, cwd: Path, env: dict[str, str], demos: list[Demo], taken_ports: set[int],
                budget: Budget) -> None:
    if block.language == "python":
        script = cwd / f"readme_line_{block.line_number}.py"
        script.write_text(block.text + "\n")
        ran = run([sys.executable, str(script)], cwd, env, budget.step_s())
        if ran.code != 0:
            pytest.fail(failure(block, "the python block", ran, demos[0]), pytrace=False)
        return
    for line in commands(block):
        if line.startswith(DEMO_COMMAND + " "):
            demos.append(start_demo(demo_arguments(line, taken_ports), cwd, env, f"demo{len(demos)}", budget))
            continue
        ran = run(["bash", "-e", "-c", line], cwd, env, budget.step_s())
        if ran.code != 0:
            pytest.fail(failure(block, f"the line\n    {line}\n", ran, demos[0]), pytrace=False)
