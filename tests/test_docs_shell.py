"""The docs tests' shell session (tests/docs_support.py `Shell`): a step ends at its
first failing command, and the session goes on with what earlier steps set."""
from docs_support import Sandbox, Shell


def test_a_step_ends_at_its_first_failing_command_and_the_session_goes_on(tmp_path):
    shell = Shell(Sandbox(tmp_path), "session")
    try:
        failing = shell.run("fails", "echo one\nfalse\necho never\nsleep 30\n", timeout_s=20)
        assert not failing.ok and failing.failed == ["__FAILED__ rc=1 :: false"]
        assert "one" in failing.output and "never" not in failing.output
        assert shell.run("sets", f"export STEP_VAR=kept\ncd {tmp_path}\n").ok
        reads = shell.run("reads", "echo \"$STEP_VAR $PWD\"\n")
        assert reads.ok and f"kept {tmp_path}" in reads.output
        # a function's failure ends the step at the line that called it
        called = shell.run("calls", "f() { return 3; }\nf\necho never\n")
        assert len(called.failed) == 1 and called.failed[0].startswith("__FAILED__ rc=3 :: ")
        assert "never" not in called.output
    finally:
        shell.kill()
