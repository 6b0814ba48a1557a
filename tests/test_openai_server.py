"""``pyvene-dist serve`` (transformers' OpenAI-compatible server over the ReFTs' continuous batching), started as
docs/serving.md starts it and called over the loopback with the ``openai`` client as users call it: each answer
equals generating its prompt alone with its ReFT through pyreft; then issue 50's cases of the old hand-written
server (docs/examples/serve_many.py at 09d6d98), each now a clear error or the right result. The server is the
session's (tests/conftest.py's ``serving_server``: ``serving_refts.running_server``, started once for this module and
tests/test_inputs.py's drawn requests), over the session's ReFTs and pyreft's answers (``serving_saved``).
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("pyreft")
openai = pytest.importorskip("openai")

import pyvene_dist  # noqa: E402
from pyvene_dist.serving import command  # noqa: E402
from pyvene_dist.serving.batching import SERVER  # noqa: E402
from serving_refts import BODY_TIMEOUT, NEW_TOKENS, needs_transformers  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), needs_transformers(SERVER, "pyvene-dist serve")]

PROMPTS = ["red cat runs fast", "big dog", "small bird sits on the tree", "cold river stone sits", "green tree",
           "the red river runs"]


@pytest.fixture(scope="module")
def served(serving_saved, serving_server):
    """The server of ``lo``, ``no`` and ``di`` (``lo2`` is loaded over HTTP by a test), the ReFTs' folders on the tiny
    base (its tokenizer given a chat template), the tokenizer, and pyreft's answers."""
    return serving_server, serving_saved.folders, serving_saved.tokenizer, serving_saved.alone


def client(url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def text_of(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


def test_the_openai_client_gets_each_reft_as_alone(served):
    """Six completions at once naming three ReFTs and the base (by name, or its absence), a chat completion, a
    streamed one and an every-token one: each text is that of the prompt generated alone with its ReFT."""
    url, _, tokenizer, alone = served
    asked = [("lo", PROMPTS[0]), ("base", PROMPTS[1]), ("no", PROMPTS[2]), ("di", PROMPTS[3]), ("lo", PROMPTS[4]),
             ("di", PROMPTS[5])]
    with ThreadPoolExecutor(len(asked)) as pool:
        answers = list(pool.map(lambda item: client(url).completions.create(
            model=item[0], prompt=item[1], max_tokens=NEW_TOKENS, temperature=0), asked))
    with pyvene_dist.patched():
        for (model, prompt), answer in zip(asked, answers):
            expected = alone(None if model == "base" else model, prompt)
            assert answer.choices[0].text == text_of(tokenizer, expected), (model, prompt)
            assert answer.usage.completion_tokens == len(expected) and answer.model == model
            if model != "base":  # not vacuous
                assert expected != alone(None, prompt), (model, prompt)

        messages = [{"role": "user", "content": "red cat runs"}]
        chat = client(url).chat.completions.create(model="lo", messages=messages, max_tokens=NEW_TOKENS)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert chat.choices[0].message.content == text_of(tokenizer, alone("lo", ids["input_ids"]))

        stream = client(url).completions.create(model="no", prompt=PROMPTS[2], max_tokens=NEW_TOKENS, stream=True)
        chunks = list(stream)
        assert chunks[-1].usage.completion_tokens == len(alone("no", PROMPTS[2]))
        assert "".join(chunk.choices[0].text for chunk in chunks) == answers[2].choices[0].text

        # every-token mode: its first token comes from the prompt alone, and the server stops at the end of sequence
        changed = next(prompt for prompt in PROMPTS if alone("lo", prompt, False, min_new_tokens=0) !=
                       alone(None, prompt, False, min_new_tokens=0))
        every = client(url).completions.create(model="lo", prompt=changed, max_tokens=NEW_TOKENS,
                                               extra_body={"intervene_on_prompt": False})
        assert every.choices[0].text == text_of(tokenizer, alone("lo", changed, False, min_new_tokens=0))

    assert [model.id for model in client(url).models.list().data] == ["base", "di", "lo", "no"]


def post(url: str, body, path: str = "/v1/completions") -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


#: Issue 50's inputs to the old server (and a few more), each refused naming the field at fault.
REFUSED = [
    ("max-tokens-true", {"model": "lo", "prompt": "red cat", "max_tokens": True}, 400, "max_tokens"),
    ("n-2", {"model": "lo", "prompt": "red cat", "n": 2}, 400, "n"),
    ("stop", {"model": "lo", "prompt": "red cat", "stop": ["cat"]}, 400, "stop"),
    ("logprobs", {"model": "lo", "prompt": "red cat", "logprobs": 2}, 400, "logprobs"),
    ("echo", {"model": "lo", "prompt": "red cat", "echo": True}, 400, "echo"),
    ("top-p", {"model": "lo", "prompt": "red cat", "top_p": 0.5}, 400, "top_p"),
    ("sampling", {"model": "lo", "prompt": "red cat", "temperature": 0.7}, 400, "temperature"),
    ("long-prompt", {"model": "lo", "prompt": " ".join(["red cat runs"] * 540)}, 400, "prompt"),
    ("past-positions", {"model": "lo", "prompt": "red cat", "max_tokens": 4096}, 400, "max_tokens"),
    ("model-list", {"model": ["poet"], "prompt": "red cat"}, 400, "model"),
    ("unknown-model", {"model": "poet", "prompt": "red cat"}, 404, "model"),
    ("too-short", {"model": "di", "prompt": "red"}, 400, "prompt"),
    ("empty-prompt", {"model": "lo", "prompt": ""}, 400, "prompt"),
    ("unknown-field", {"model": "lo", "prompt": "red cat", "beams": 2}, 400, "beams"),
    ("bad-messages", {"model": "lo", "messages": [{"role": "user"}]}, 400, "messages"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[case[0] for case in REFUSED])
def test_issue_50_requests_are_refused_naming_the_field(served, case):
    _, body, status, param = case
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    code, reply = post(served[0], body, path)
    assert (code, reply["error"]["param"]) == (status, param), reply


def test_a_too_short_prompt_is_refused_alone_beside_three_answered(served):
    """At 09d6d98 one too-short prompt turned the four requests of its batch into 500s."""
    url, _, tokenizer, alone = served
    bodies = [{"model": "di", "prompt": "red"}] + [{"model": "lo", "prompt": prompt} for prompt in PROMPTS[:3]]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda body: post(url, body), bodies))
    assert replies[0][0] == 400
    with pyvene_dist.patched():
        assert [reply for reply in replies[1:]] == [
            (200, reply[1]) for reply in replies[1:]] and [reply[1]["choices"][0]["text"] for reply in replies[1:]] == \
            [text_of(tokenizer, alone("lo", prompt)) for prompt in PROMPTS[:3]]


def raw(url: str, request: bytes, wait: float = 30) -> bytes:
    """``request`` sent as it is on one connection; what the server answers before closing (or ``wait`` s)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as connection:
        connection.sendall(request)
        found = b""
        while chunk := connection.recv(65536):
            found += chunk
        return found


def test_broken_http_is_answered_and_never_hangs(served):
    """A non-numeric Content-Length (a 500 at 09d6d98) is a 400; one larger than the body (a hang there) is a 408
    after the body timeout; 40 connections at once (some reset there: listen backlog 5) are all answered."""
    url = served[0]
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    assert raw(url, f"{head}Content-Length: abc\r\n\r\n{{}}".encode()).startswith(b"HTTP/1.1 400")
    start = time.monotonic()
    answer = raw(url, f"{head}Content-Length: 100\r\n\r\n{{\"model\"".encode())
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within" in answer, answer
    assert time.monotonic() - start < BODY_TIMEOUT + 20
    with ThreadPoolExecutor(40) as pool:
        replies = list(pool.map(lambda index: post(url, {"model": "lo", "prompt": PROMPTS[index % 6],
                                                         "max_tokens": 2}), range(40)))
    assert [code for code, _ in replies] == [200] * 40


def test_refts_load_and_unload_over_http(served):
    url, folders, tokenizer, alone = served
    assert post(url, {"model": "lo2", "prompt": PROMPTS[0]})[0] == 404
    assert post(url, {"reft_name": "lo2", "reft_path": str(folders["lo2"])}, "/v1/load_reft") == \
        (200, {"status": "loaded", "model": "lo2"})
    code, reply = post(url, {"model": "lo2", "prompt": PROMPTS[0]})
    with pyvene_dist.patched():
        assert (code, reply["choices"][0]["text"]) == (200, text_of(tokenizer, alone("lo2", PROMPTS[0])))
    assert post(url, {"reft_name": "lo2"}, "/v1/unload_reft") == (200, {"status": "unloaded", "model": "lo2"})
    assert post(url, {"model": "lo2", "prompt": PROMPTS[0]})[0] == 404
    code, reply = post(url, {"reft_name": "x", "reft_path": str(folders["lo2"].parent / "missing")}, "/v1/load_reft")
    assert (code, reply["error"]["param"]) == (400, "reft_path") and "does not exist" in reply["error"]["message"]


@needs_transformers(SERVER, "pyvene-dist serve")
def test_a_server_that_fails_to_build_stops_its_manager(serving_saved, monkeypatch):
    """``build_app`` starts the continuous batching manager, then builds the app: an error there (5.23's server
    internals, before the version check) left the manager's thread running, and the process never ended."""
    from pyvene_dist.serving import openai_api
    from serving_refts import load_many, small_cache

    def broken(server):
        raise RuntimeError("building the app failed")

    monkeypatch.setattr(openai_api.ReftServer, "_build", broken)
    many, managers = load_many(serving_saved), []
    start = many.init_continuous_batching
    monkeypatch.setattr(many, "init_continuous_batching", lambda *args: managers.append(start(*args)) or managers[-1])
    with pytest.raises(RuntimeError, match="building the app failed"):
        openai_api.build_app(many, serving_saved.tokenizer, model_id="base", batching=small_cache())
    assert len(managers) == 1
    thread = managers[0]._generation_thread  # None once stopped; told to stop, it ends after its start-up
    if thread is not None:
        thread.join(timeout=120)
    assert not managers[0].is_running()


@pytest.mark.parametrize("flags, words", [
    (["--max_requests", "0"], "--max_requests/--max-requests: expected a positive int, found '0'"),
    (["--body_timeout", "-1"], "--body_timeout/--body-timeout: expected a positive float, found '-1'"),
    (["--max_queue", "x"], "--max_queue/--max-queue: expected a positive int, found 'x'"),
    (["--reft", "poet"], "--reft 'poet': expected NAME=FOLDER"),
], ids=["max-requests-0", "negative-timeout", "queue-x", "reft-no-folder"])
def test_serve_flags_are_checked(flags, words, capsys):
    """At 09d6d98 serve_many.py took --max_batch 0 and a negative --batch_wait_ms."""
    with pytest.raises(SystemExit):
        command.parse_arguments(["--model", ".", *flags])
    assert words in capsys.readouterr().err


def test_the_pages_curl_lines_answer(served):
    """docs/serving.md's curl lines, against this server (its ReFTs stand for the page's poet and coder)."""
    import re
    import subprocess
    from pathlib import Path

    url = served[0]
    page = (Path(__file__).parents[1] / "docs" / "serving.md").read_text()
    lines = [line for line in page.splitlines() if line.startswith("curl ")]
    assert len(lines) == 3, lines
    for line in lines:
        line = line.replace("localhost:8000", url.removeprefix("http://")).replace('"poet"', '"lo"').replace(
            '"coder"', '"no"')
        found = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60, check=True)
        answer = json.loads(found.stdout)
        assert "error" not in answer and (answer.get("choices") or answer.get("data")), (line, answer)
        assert not re.search(r"Internal Server Error", found.stdout)


def test_serve_many_is_pyvene_dist_serve(monkeypatch, capsys):
    """docs/examples/serve_many.py, retired to a few lines: pyvene-dist serve's flags and checks (run in this
    process: a new interpreter spends its time importing)."""
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "docs" / "examples" / "serve_many.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--model", ".", "--max_requests", "0"])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(script), run_name="__main__")
    assert stopped.value.code == 2
    assert "--max_requests/--max-requests: expected a positive int" in capsys.readouterr().err
