"""``m2n-async``: every subcommand answers a bad value with one line naming the flag and the
value and a non-zero status (2 for a bad option), before it starts anything; ``--help`` of each
command gives the exit statuses the command returns; both ways of starting it work."""

from __future__ import annotations

import os
import resource
import shutil
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from m2n_async import _demo
from m2n_async.cli import main

ROOT = Path(__file__).resolve().parents[1]
PLAN = """\
trainer_mesh = [2]
worker_mesh = [2]

[[params]]
name = "w"
dtype = "float32"
shape = [4, 4]
source = ["shard(0)"]
dest = ["shard(1)"]
"""


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse's own errors and --help end this way
        rc = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line(err: str, *words: str) -> None:
    """``err`` is one line, no traceback, and names every one of ``words``."""
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)


@pytest.fixture
def token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("s3cret\n")  # a trailing newline, as editors and `echo` write it
    path.chmod(0o600)
    return path


@pytest.fixture
def busy_port() -> Iterator[int]:
    # A listening socket the store cannot bind too: its start fails at once, so a test of
    # what comes before serving needs no signal to stop it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# -- the entry points ------------------------------------------------------------------------


def _run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env,
                          cwd=ROOT, **kw)  # type: ignore[call-overload,no-any-return]


def test_python_dash_m_and_the_script_both_run_the_command() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"m2n-async": "m2n_async.cli:main"}
    by_module = _run([sys.executable, "-m", "m2n_async.cli", "--help"])
    assert by_module.returncode == 0 and "{demo,plan,store}" in by_module.stdout
    script = shutil.which("m2n-async", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("m2n-async is not installed next to this interpreter")
    by_script = _run([script, "--help"])
    assert (by_script.returncode, by_script.stdout) == (0, by_module.stdout)
    no_command = _run([script])
    assert no_command.returncode == 2 and "required: command" in no_command.stderr


@pytest.mark.parametrize(("command", "statuses"), [
    ("plan", "Exit status: 0 valid, 1 invalid (or --require not met), 2 unreadable file or "
             "bad option."),
    ("demo", "Exit status: 0 verified, 1 mismatch or failure, 2 bad option, 130 interrupted."),
    ("store", "Exit status: 0 stopped by SIGTERM or Ctrl-C, 1 cannot listen (address in use, "
              "or a host that does not resolve or is not this one's), 2 bad option or token "
              "file."),
])
def test_each_commands_help_gives_its_exit_statuses(capsys: pytest.CaptureFixture[str],
                                                    command: str, statuses: str) -> None:
    rc, out, err = _cli(capsys, command, "--help")
    assert (rc, err) == (0, "")
    assert statuses in " ".join(out.split())


# -- store ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("flag", "value"), [
    ("--port", "-1"), ("--port", "65536"), ("--max-frame", "0"), ("--max-frame", "63"),
    ("--max-frame", str(2**32)), ("--max-bytes", "0"), ("--max-job-bytes", "-1"),
    ("--max-output-bytes", "100"), ("--max-partial-bytes", "100"),
    ("--max-connections", "0"), ("--host", ""),
])
def test_store_names_the_flag_and_value_it_refuses(capsys: pytest.CaptureFixture[str],
                                                   token: Path, flag: str, value: str) -> None:
    rc, out, err = _cli(capsys, "store", "--token-file", str(token), flag, value)
    assert (rc, out) == (2, "")
    _one_line(err, f"{flag} {value!r}" if value == "" else f"{flag} {value}")


def test_store_budget_errors_say_which_flag_sets_the_floor(capsys: pytest.CaptureFixture[str],
                                                           token: Path) -> None:
    # The floor is 2 x --max-frame: the message says so in flags, not server argument names.
    rc, _, err = _cli(capsys, "store", "--token-file", str(token), "--max-frame", "1000",
                      "--max-output-bytes", "100")
    assert rc == 2
    _one_line(err, "--max-output-bytes 100", "--max-frame")
    assert "max_output" not in err


@pytest.mark.parametrize("kind", ["absent", "empty", "blank", "directory", "binary", "path"])
def test_store_token_file_problems_are_one_line(capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path, kind: str) -> None:
    path = tmp_path / kind
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "blank":
        path.write_text(" \n\t\n")
    elif kind == "directory":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(b"\xff\xfe\x00token")
    arg = "" if kind == "path" else str(path)
    rc, out, err = _cli(capsys, "store", "--token-file", arg)
    assert (rc, out) == (2, "")
    _one_line(err, "--token-file")
    if arg:
        assert arg in err
    else:
        assert "--token-file ''" in err  # the empty argument, not the directory "." it means


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_store_reads_a_bounded_token_file() -> None:
    # /dev/zero as the token file: refused after a bounded read, not read until memory runs
    # out (the child's address space is capped so that an unbounded read fails fast too).
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    proc = _run([sys.executable, "-m", "m2n_async.cli", "store", "--token-file", "/dev/zero"],
                preexec_fn=cap)
    assert proc.returncode == 2, proc.stderr
    _one_line(proc.stderr, "--token-file /dev/zero")


def test_store_warns_of_a_token_file_other_users_can_read(
        capsys: pytest.CaptureFixture[str], token: Path, busy_port: int) -> None:
    # docs/security.md: the token is a password, in a file only the job's user can read.
    argv = ("store", "--token-file", str(token), "--port", str(busy_port))
    rc, _, err = _cli(capsys, *argv)
    assert rc == 1 and "readable" not in err  # 0600: no warning
    token.chmod(0o644)
    rc, _, err = _cli(capsys, *argv)
    warning, failure = err.strip().splitlines()
    assert rc == 1 and f"--token-file {token}" in warning and "0644" in warning
    assert "chmod 600" in warning and "Address already in use" in failure


def test_store_a_port_in_use_or_a_foreign_address_is_status_1(
        capsys: pytest.CaptureFixture[str], token: Path, busy_port: int) -> None:
    rc, out, err = _cli(capsys, "store", "--token-file", str(token), "--port", str(busy_port))
    assert (rc, out) == (1, "")
    _one_line(err, f"127.0.0.1:{busy_port}", "in use")
    # TEST-NET-1 (RFC 5737): an address no host has, so binding it fails without a lookup
    rc, out, err = _cli(capsys, "store", "--token-file", str(token), "--host", "192.0.2.1")
    assert (rc, out) == (1, "")
    _one_line(err, "192.0.2.1")


@pytest.mark.parametrize(("flag", "value"), [("--port", "abc"), ("--max-frame", "1.5"),
                                             ("--loop", "trio")])
def test_store_unparsable_values_are_argparse_errors(capsys: pytest.CaptureFixture[str],
                                                     token: Path, flag: str, value: str) -> None:
    rc, out, err = _cli(capsys, "store", "--token-file", str(token), flag, value)
    assert (rc, out) == (2, "")
    assert f"argument {flag}: invalid" in err and value in err and "Traceback" not in err


# -- plan -----------------------------------------------------------------------------------


@pytest.fixture
def plan(tmp_path: Path) -> Path:
    path = tmp_path / "plan.toml"
    path.write_text(PLAN)
    return path


@pytest.mark.parametrize(("flag", "value"), [
    ("--bandwidth", "0"), ("--bandwidth", "-1"), ("--bandwidth", "nan"),
    ("--bandwidth", "inf"), ("--bandwidth", "1e400"),
    ("--bucket-bytes", "0"), ("--bucket-bytes", "-1"), ("--bucket-bytes", ""),
    ("--bucket-bytes", "9223372036854775808"),
    ("--coalesce-below", "-1"), ("--coalesce-below", "lots"),
])
def test_plan_names_the_flag_and_value_it_refuses(capsys: pytest.CaptureFixture[str],
                                                  plan: Path, flag: str, value: str) -> None:
    rc, out, err = _cli(capsys, "plan", str(plan), flag, value)
    assert (rc, out) == (2, "")
    _one_line(err, flag)
    assert value in err or (value == "1e400" and "inf" in err)  # read as the float it is


@pytest.mark.parametrize("zero", ["0", "0.0", "0B", "0 MiB"])
def test_plan_coalesce_below_zero_is_off_however_it_is_written(
        capsys: pytest.CaptureFixture[str], plan: Path, zero: str) -> None:
    rc, off, _ = _cli(capsys, "plan", str(plan), "--coalesce-below", zero)
    assert rc == 0 and "m2n not coalesced" in off


@pytest.mark.parametrize("value", ["{", "[]", '{"m2n": [1, 2]}', '{"m2n": [-1, 0, 1]}',
                                   '{"bogus": [1, 1, 1]}'])
def test_plan_cost_errors_name_where_the_terms_came_from(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, plan: Path,
        value: str) -> None:
    rc, out, err = _cli(capsys, "plan", str(plan), "--costs", value)
    assert (rc, out) == (2, "")
    _one_line(err, "--costs")
    monkeypatch.setenv("M2N_ASYNC_COSTS", value)
    rc, out, err = _cli(capsys, "plan", str(plan))
    assert (rc, out) == (2, "")
    _one_line(err, "$M2N_ASYNC_COSTS")


def test_plan_file_problems(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, err = _cli(capsys, "plan", str(tmp_path / "missing.toml"))
    assert (rc, out) == (2, "")
    _one_line(err, "missing.toml", "No such file")
    rc, out, err = _cli(capsys, "plan", str(tmp_path))
    assert (rc, out) == (2, "")
    _one_line(err, str(tmp_path), "directory")
    rc, out, err = _cli(capsys, "plan", "")
    assert (rc, out) == (2, "")
    _one_line(err, "SPEC ''")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe")
    rc, out, err = _cli(capsys, "plan", str(binary))
    assert (rc, out) == (1, "")  # read, but not TOML: an invalid plan
    _one_line(err, "binary.toml", "not valid TOML")


# -- demo -----------------------------------------------------------------------------------


# The demo's smallest job: what a probe of one bad value adds to it is the value alone.
TINY_DEMO = ["demo", "--trainers", "1", "--workers", "1", "--rounds", "1", "--size-mb", "0.01"]


@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A demo that gets past its checks fails the test instead of starting processes."""
    def spawn(*args: object, **kwargs: object) -> str:
        raise AssertionError("the demo started its processes")
    monkeypatch.setattr(_demo, "_parent", spawn)


@pytest.mark.parametrize(("flag", "value"), [
    ("--trainers", "0"), ("--workers", "-1"), ("--rounds", "0"), ("--trainers", "4097"),
    ("--workers", str(10**400)), ("--rounds", str(10**400)),
    ("--size-mb", "0"), ("--size-mb", "nan"), ("--size-mb", "inf"), ("--size-mb", "1e400"),
    ("--size-mb", "1e307"),
    ("--bucket-mb", "0"), ("--bucket-mb", "inf"), ("--bucket-mb", "1e-9"),
    ("--bucket-mb", "1e20"),
    ("--round-timeout", "0"), ("--round-timeout", "-1"), ("--round-timeout", "nan"),
    ("--round-timeout", "inf"), ("--round-timeout", "1e300"),
])
def test_demo_refuses_a_bad_value_before_it_starts(capsys: pytest.CaptureFixture[str],
                                                   no_spawn: None, flag: str, value: str
                                                   ) -> None:
    rc, out, err = _cli(capsys, *TINY_DEMO, flag, value)
    assert (rc, out) == (2, "")
    _one_line(err, flag)
    assert value in err or str(float(value)) in err


def test_demo_refuses_a_job_larger_than_this_hosts_memory(capsys: pytest.CaptureFixture[str],
                                                         no_spawn: None) -> None:
    # Hidden sizes are multiples of 16 x lcm(trainers, workers): 97 and 89 make the smallest
    # model terabytes, whatever --size-mb asks for; said before any process starts.
    rc, out, err = _cli(capsys, "demo", "--trainers", "97", "--workers", "89")
    assert (rc, out) == (2, "")
    _one_line(err, "--trainers 97", "--workers 89", "--size-mb 350", "memory")
    rc, out, err = _cli(capsys, *TINY_DEMO, "--size-mb", "1e12")
    assert (rc, out) == (2, "")
    _one_line(err, "--size-mb 1e+12", "memory")


@pytest.mark.parametrize(("flag", "value"), [("--trainers", "x"), ("--size-mb", "big"),
                                             ("--transport", "tcp")])
def test_demo_unparsable_values_are_argparse_errors(capsys: pytest.CaptureFixture[str],
                                                    no_spawn: None, flag: str, value: str
                                                    ) -> None:
    rc, out, err = _cli(capsys, "demo", flag, value)
    assert (rc, out) == (2, "")
    assert f"argument {flag}: invalid" in err and value in err and "Traceback" not in err

