"""The pure parts of exec and forward (contract §14): the worker link's proof, its frames,
the request's parsing and the client's port argument. The sessions themselves are in
tests/integration/test_exec.py."""

from __future__ import annotations

import pytest

from service.client.exec_client import parse_forward, socket_url
from service.exec.router import _resize
from service.exec.service import Refusal, parse_cmd
from service.nodes import exec_link
from workers.launcher import exec_command


def test_only_the_secret_over_this_nonce_proves_a_request() -> None:
    secret, nonce = exec_link.new_secret(), exec_link.new_nonce()
    request = {"op": "exec", "job_id": 1, "argv": ["id"]}
    line = exec_link.signed_line(secret, nonce, request)
    assert exec_link.verified(secret, nonce, line) == request
    assert exec_link.verified(exec_link.new_secret(), nonce, line) is None
    assert exec_link.verified(secret, exec_link.new_nonce(), line) is None  # replayed elsewhere
    tampered = line.replace(b'"id"', b'"sh"')
    assert exec_link.verified(secret, nonce, tampered) is None
    for junk in (b"", b"{}", b"[1]", b'{"request": 1, "mac": "x"}', b"\xff\n"):
        assert exec_link.verified(secret, nonce, junk) is None


def test_frames() -> None:
    framed = exec_link.frame(exec_link.DATA, b"abc")
    assert exec_link.HEADER.unpack(framed[: exec_link.HEADER.size]) == (exec_link.DATA, 3)
    assert framed[exec_link.HEADER.size :] == b"abc"


def test_cmd_is_split_as_a_shell_would() -> None:
    assert parse_cmd("sh -c 'exit 3'") == ("sh", "-c", "exit 3")
    for bad in ("", "   ", "'open", "a\0b", "x" * 20_000):
        with pytest.raises(Refusal) as refused:
            parse_cmd(bad)
        assert refused.value.status == 400


def test_resize_messages() -> None:
    assert _resize('{"resize": [24, 80]}') == [24, 80]
    for junk in (None, "", "x", '{"resize": [0, 80]}', '{"resize": [true, 80]}', '{"resize": [1]}', "[]"):
        assert _resize(junk) is None


def test_forward_ports_and_socket_urls() -> None:
    assert parse_forward("6006") == (6006, 6006)
    assert parse_forward("0:8888") == (0, 8888)
    for bad in ("x", "1:0", "70000", "1:2:3"):
        with pytest.raises(ValueError, match="port"):
            parse_forward(bad)
    assert socket_url("https://h:1/", "/v1/x", {"a": "b c"}) == "wss://h:1/v1/x?a=b+c"
    assert socket_url("http://h", "/v1/x", {}).startswith("ws://h/v1/x")


def test_a_root_rank_is_never_entered() -> None:
    with pytest.raises(exec_command.Refused):
        exec_command.sandboxed_argv({}, 5, 0, 1000, ["true"])
    argv = exec_command.sandboxed_argv({"pid": 7}, 5, 2000000001, 2000000001, ["true"])
    assert "--pid=/proc/self/fd/7" in argv and "--root=/proc/self/fd/5" in argv
    assert "--no-new-privs" in argv and argv[-1] == "true"


def test_sessions_per_user_and_per_job_are_limited() -> None:
    from service.exec.service import Slots, Target

    slots = Slots(per_user=2, per_job=2)

    def target(user: int, job: int) -> Target:
        return Target(
            op="exec", job_id=job, attempt=1, node_rank=0, local_rank=0, user_id=user, user_name="u"
        )

    with slots.take(target(1, 10)), slots.take(target(1, 11)):
        with pytest.raises(Refusal) as refused, slots.take(target(1, 12)):
            pass
        assert refused.value.status == 429
        # another user takes job 10's second; a third on job 10 is refused
        with slots.take(target(2, 10)), pytest.raises(Refusal), slots.take(target(3, 10)):
            pass
    with slots.take(target(1, 12)), slots.take(target(1, 13)):  # all given back
        pass
