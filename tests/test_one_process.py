"""``helpers.run_in_one_process`` (``tests/one_process.py``) reports each command as its own ``python`` process
would: exit status, stdout and stderr (C-level writes included), a traceback for an escaping exception, and
``sys.argv`` / ``__name__`` as the script sees them; a command's failure does not stop the ones after it."""

from __future__ import annotations

from helpers import run_in_one_process


def test_each_command_gets_its_own_status_and_output(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys\n"
        "if __name__ != '__main__':\n    raise SystemExit(9)\n"
        "mode = sys.argv[1]\n"
        "print('out', sys.argv[1:])\n"
        "os.write(2, b'c-level\\n')\n"
        "if mode == 'raise':\n    raise ValueError('boom')\n"
        "if mode == 'exit':\n    sys.exit(2)\n"
        "if mode == 'message':\n    sys.exit('bad thing')\n")
    commands = {mode: [str(script), mode, "x=1"] for mode in ("raise", "exit", "message", "ok")}
    commands["module"] = ["-m", "json.tool", str(tmp_path / "missing.json")]
    procs = run_in_one_process(commands, tmp_path / "logs")
    assert {name: p.returncode for name, p in procs.items()} == {"raise": 1, "exit": 2, "message": 1, "ok": 0,
                                                                 "module": 2}
    assert "missing.json" in procs.pop("module").stderr  # ``-m``: the module's own command line
    for mode, proc in procs.items():
        assert proc.stdout == f"out ['{mode}', 'x=1']\n" and "c-level" in proc.stderr
    assert "Traceback" in procs["raise"].stderr and "ValueError: boom" in procs["raise"].stderr
    assert "bad thing" in procs["message"].stderr
    assert all("Traceback" not in procs[m].stderr for m in ("exit", "message", "ok"))
