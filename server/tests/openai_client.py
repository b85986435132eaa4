"""The official `openai` client against ndscope-server on loopback.

Starts the server binary given as the first argument on data/llama-tiny (and a throttled second one
for overload and shutdown), then checks completions and chat, streamed and not, against
transformers' greedy generations in data/llama-tiny/reference.json; `stop`, `n`, `logprobs`; that a
stream closed by its client frees its blocks; every bad input's 400; 64 concurrent streams; the 429
past a full queue; and a clean shutdown with a request in flight.

    python3 server/tests/openai_client.py target/release/ndscope-server

(`.ci/server` installs the client and runs this.)
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request

import openai

MODEL_DIR = "data/llama-tiny"
NAME = "llama-tiny"
REFERENCE = json.load(open(os.path.join(MODEL_DIR, "reference.json")))
# transformers generated 24 tokens after each prompt, with the end tokens suppressed until then.
GREEDY = {"max_tokens": 24, "temperature": 0, "extra_body": {"min_tokens": 24}}


class Server:
    def __init__(self, binary, *args):
        self.proc = subprocess.Popen(
            [binary, "--model", MODEL_DIR, "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        line = self.proc.stdout.readline()
        found = re.search(r"on (http://[0-9.:]+)", line)
        if not found:
            raise RuntimeError(f"the server did not start: {line}{self.proc.stdout.read()}")
        self.url = found.group(1)
        self.lines = []
        threading.Thread(target=self._drain, daemon=True).start()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def _drain(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return r.status, r.read().decode()

    def post(self, path, body, raw=False):
        data = body if raw else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode()

    def metrics(self):
        _, text = self.get("/metrics")
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                values[key] = float(value)
        return values

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=20)


def wait_for(condition, what, seconds=10):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_models(s):
    models = s.client.models.list()
    assert [m.id for m in models.data] == [NAME], models
    status, body = s.get("/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_greedy_completions_equal_transformers(s):
    for prompt, full in REFERENCE["greedy"].items():
        want = full[len(prompt):]
        got = s.client.completions.create(model=NAME, prompt=prompt, **GREEDY)
        assert got.choices[0].text == want, (got.choices[0].text, want)
        assert got.choices[0].finish_reason == "length"
        assert got.usage.completion_tokens == 24
        streamed = s.client.completions.create(model=NAME, prompt=prompt, stream=True, **GREEDY)
        text = "".join(c.choices[0].text for c in streamed if c.choices)
        assert text == want, (text, want)


def test_chat_streamed_equals_whole(s):
    messages = REFERENCE["conversation"]
    whole = s.client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=20, temperature=0
    )
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 20
    pieces, finish, roles = [], None, []
    for chunk in s.client.chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage:
            assert chunk.usage.completion_tokens == whole.usage.completion_tokens
        for c in chunk.choices:
            roles.append(c.delta.role)
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert roles[0] == "assistant"
    assert "".join(pieces) == choice.message.content
    assert finish == choice.finish_reason


def test_stop_strings_across_tokens(s):
    prompt, full = next(iter(REFERENCE["greedy"].items()))
    want = full[len(prompt):]
    for stop in ["they", "e, w", "\n\n", "zzz-never"]:
        got = s.client.completions.create(model=NAME, prompt=prompt, stop=[stop], **GREEDY)
        expected = want.split(stop)[0]
        assert got.choices[0].text == expected, (stop, got.choices[0].text, expected)
        assert got.choices[0].finish_reason == ("length" if stop not in want else "stop")
        streamed = s.client.completions.create(
            model=NAME, prompt=prompt, stop=stop, stream=True, **GREEDY
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_n_samples(s):
    prompt = "def main():\n    return"
    greedy = s.client.completions.create(model=NAME, prompt=prompt, n=2, **GREEDY)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].text == greedy.choices[1].text
    assert greedy.usage.completion_tokens == 48
    args = dict(model=NAME, prompt=prompt, n=2, max_tokens=16, temperature=1.0, seed=7)
    a = s.client.completions.create(**args)
    b = s.client.completions.create(**args)
    assert [c.text for c in a.choices] == [c.text for c in b.choices], "a seed repeats"
    assert a.choices[0].text != a.choices[1].text, "each sample draws its own"
    chat = s.client.chat.completions.create(
        model=NAME, messages=REFERENCE["conversation"], n=2, max_tokens=8, seed=3, stream=True
    )
    seen = {c.index for chunk in chat for c in chunk.choices}
    assert seen == {0, 1}


def test_logprobs(s):
    prompt = next(iter(REFERENCE["greedy"]))
    got = s.client.completions.create(model=NAME, prompt=prompt, logprobs=1, **GREEDY)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 24
    assert all(x <= 0 for x in lp.token_logprobs)
    assert "".join(lp.tokens) == got.choices[0].text
    chat = s.client.chat.completions.create(
        model=NAME, messages=REFERENCE["conversation"], max_tokens=6, temperature=0, logprobs=True
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(c.logprob <= 0 for c in content)


def test_bad_inputs_are_400(s):
    ok = {"model": NAME, "prompt": "A scope", "max_tokens": 4}
    context = 128
    cases = {
        "bad JSON": b'{"model": "llama-tiny", "prompt": ',
        "not an object": b"[1, 2, 3]",
        "no body": b"",
        "missing model": {"prompt": "A scope"},
        "missing prompt": {"model": NAME},
        "unknown model": {**ok, "model": "gpt-5"},
        "negative max_tokens": {**ok, "max_tokens": -1},
        "huge max_tokens": {**ok, "max_tokens": 10**12},
        "max_tokens not a number": {**ok, "max_tokens": "many"},
        "prompt past the context": {**ok, "prompt": "scope " * (2 * context)},
        "token outside the vocabulary": {**ok, "prompt": [1, 2, 100000]},
        "empty prompt": {**ok, "prompt": ""},
        "temperature < 0": {**ok, "temperature": -0.5},
        "top_p 0": {**ok, "top_p": 0},
        "n 0": {**ok, "n": 0},
        "logprobs 9": {**ok, "logprobs": 9},
        "five stops": {**ok, "stop": ["a", "b", "c", "d", "e"]},
        "body over the limit": json.dumps({**ok, "pad": "x" * (2 << 20)}).encode(),
    }
    for what, body in cases.items():
        raw = isinstance(body, bytes)
        status, _, text = s.post("/v1/completions", body, raw=raw)
        assert status == 400, (what, status, text)
        error = json.loads(text)["error"]
        assert error["type"] == "invalid_request_error" and error["message"], (what, error)
        if what == "prompt past the context":
            assert error["param"] == "prompt", error
    chat_cases = {
        "no messages": {"model": NAME},
        "empty messages": {"model": NAME, "messages": []},
        "image part": {
            "model": NAME,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        },
    }
    for what, body in chat_cases.items():
        status, _, text = s.post("/v1/chat/completions", body)
        assert status == 400, (what, status, text)
    try:
        s.client.completions.create(model=NAME, prompt="x", max_tokens=-3)
        raise AssertionError("accepted")
    except openai.BadRequestError as e:
        assert "max_tokens" in str(e)
    status, _, text = s.post("/v1/nothing", {})
    assert status == 404 and json.loads(text)["error"]
    m = s.metrics()
    assert m['ndscope_requests_total{outcome="rejected"}'] >= len(cases) + len(chat_cases)
    assert m['ndscope_requests_total{outcome="failed"}'] == 0


def test_many_concurrent_streams(s):
    errors, texts = [], []

    def one(i):
        try:
            stream = s.client.completions.create(
                model=NAME,
                prompt=f"request {i}: a scope owns",
                max_tokens=8 + i % 24,
                temperature=0.8,
                seed=i,
                stream=True,
            )
            texts.append("".join(c.choices[0].text for c in stream if c.choices))
        except Exception as e:  # noqa: BLE001 - every failure is reported
            errors.append(repr(e))

    start = time.time()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[:3]
    assert len(texts) == 64
    assert time.time() - start < 60
    m = s.metrics()
    assert m['ndscope_kv_blocks{state="used"}'] == 0, "every block back"
    assert m['ndscope_kv_blocks{state="promised"}'] == 0
    assert m["ndscope_running"] == 0 and m["ndscope_queue_length"] == 0
    assert m['ndscope_requests_total{outcome="failed"}'] == 0


def test_a_stream_closed_mid_way_frees_its_blocks(throttled):
    before = throttled.metrics()['ndscope_requests_total{outcome="cancelled"}']
    stream = throttled.client.completions.create(
        model=NAME,
        prompt="A scope owns",
        max_tokens=100,
        temperature=0,
        stream=True,
        extra_body={"min_tokens": 100},
    )
    got = 0
    for chunk in stream:
        got += len(chunk.choices)
        if got >= 3:
            break
    assert throttled.metrics()['ndscope_kv_blocks{state="used"}'] > 0, "it holds blocks"
    stream.close()
    wait_for(
        lambda: throttled.metrics()['ndscope_kv_blocks{state="used"}'] == 0,
        "the closed stream's blocks",
    )
    m = throttled.metrics()
    assert m['ndscope_requests_total{outcome="cancelled"}'] == before + 1
    assert m['ndscope_kv_blocks{state="promised"}'] == 0


def test_a_full_queue_answers_429(throttled):
    # batch 1, queue 1: of requests that arrive together, one runs, one waits, the rest are refused
    # at once.
    results = []

    def one():
        results.append(throttled.post("/v1/completions", {"model": NAME, "prompt": "A", "max_tokens": 6}))

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    codes = sorted(r[0] for r in results)
    assert codes.count(200) >= 2 and 429 in codes and set(codes) <= {200, 429}, codes
    refused = next(r for r in results if r[0] == 429)
    assert refused[1].get("retry-after") == "1"
    assert json.loads(refused[2])["error"]["code"] == "rate_limit_exceeded"
    assert throttled.metrics()['ndscope_requests_total{outcome="overloaded"}'] >= 1


def test_shutdown_lets_a_running_stream_finish(throttled):
    stream = throttled.client.completions.create(
        model=NAME,
        prompt="A scope owns",
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"min_tokens": 12},
    )
    first = next(iter(stream))
    assert first.choices
    throttled.proc.send_signal(signal.SIGTERM)
    rest = list(stream)  # the stream goes on to its end
    finish = [c.choices[0].finish_reason for c in rest if c.choices]
    assert finish[-1] == "length", finish
    assert throttled.proc.wait(timeout=20) == 0
    assert any("stopped" in line for line in throttled.lines), throttled.lines


def shutdown_grace_ends_what_outlasts_it(binary):
    """A request longer than the grace period is cut when it ends, and the server exits."""
    s = Server(binary, "--min-step-ms", "40", "--grace-s", "1")
    stream = s.client.completions.create(
        model=NAME,
        prompt="A scope owns",
        max_tokens=100,
        temperature=0,
        stream=True,
        extra_body={"min_tokens": 100},
    )
    assert next(iter(stream)).choices
    start = time.time()
    s.proc.send_signal(signal.SIGTERM)
    try:
        got = sum(len(c.choices) for c in stream)
    except Exception:  # noqa: BLE001 - the connection may be cut mid-chunk
        got = 0
    assert s.proc.wait(timeout=20) == 0
    assert time.time() - start < 3, "it waited past its grace"
    assert got < 99, "the stream was cut"
    assert any("passed; closing" in line for line in s.lines), s.lines


def main():
    binary = sys.argv[1]
    failures = 0
    s = Server(binary)
    throttled = Server(binary, "--batch", "1", "--queue", "1", "--min-step-ms", "40")
    try:
        tests = [(name, f) for name, f in globals().items() if name.startswith("test_")]
        # Shutdown ends the throttled server: it goes last.
        tests.sort(key=lambda t: t[0] == "test_shutdown_lets_a_running_stream_finish")
        for name, test in tests:
            server = throttled if "throttled" in test.__code__.co_varnames[:1] else s
            start = time.time()
            try:
                test(server)
                print(f"ok   {name} ({time.time() - start:.2f} s)")
            except Exception:  # noqa: BLE001 - every failure is reported
                failures += 1
                print(f"FAIL {name}")
                traceback.print_exc()
        start = time.time()
        try:
            shutdown_grace_ends_what_outlasts_it(binary)
            print(f"ok   shutdown_grace_ends_what_outlasts_it ({time.time() - start:.2f} s)")
        except Exception:  # noqa: BLE001 - every failure is reported
            failures += 1
            print("FAIL shutdown_grace_ends_what_outlasts_it")
            traceback.print_exc()
    finally:
        s.stop()
        throttled.stop()
    if s.proc.returncode != 0:
        print(f"FAIL the server ended with {s.proc.returncode}: {''.join(s.lines)[-2000:]}")
        failures += 1
    print(f"{failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
