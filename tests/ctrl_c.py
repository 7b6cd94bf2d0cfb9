"""Ctrl-C in the middle of a run, for the tests of interrupted training: a real SIGINT, as the reader's key press."""

import signal


def ctrl_c_on_call(monkeypatch, owner, name: str, call: int):
    """Patch ``owner.name`` (a function the training loop calls once a step) so that its ``call``-th call first
    raises SIGINT; returns the real function."""
    real = getattr(owner, name)
    calls = {"n": 0}

    def interrupting(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupting)
    return real
