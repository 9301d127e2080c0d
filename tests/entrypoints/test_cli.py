"""The `omnistage` command: make-tiny writes real checkpoint folders, generate prints the same text
as `Omni`, serve boots, prints how to talk to it and answers the openai client."""

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from omnistage.entrypoints import cli


def _cmd(*args):
    return [sys.executable, "-m", "omnistage.entrypoints.cli", *args]


def _env():
    return dict(os.environ, HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")


def _run(*args, timeout=180):
    return subprocess.run(_cmd(*args), capture_output=True, text=True, encoding="utf-8", env=_env(),
                          timeout=timeout)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """`omnistage make-tiny DIR --kind llm`, run in-process (the subprocess paths are generate and serve)."""
    out = tmp_path_factory.mktemp("cli")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert cli.main(["make-tiny", str(out), "--kind", "llm"]) == 0
    return out, stdout.getvalue()


def _greedy(model, prompt, max_tokens):
    from omnistage import Omni, SamplingParams

    with Omni(model=model, device="cpu", dtype="float32") as omni:
        return omni.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                             use_tqdm=False)[0].outputs[0].text


def test_make_tiny_writes_folders(tiny_dir):
    out, stdout = tiny_dir
    for arch in ("llama", "qwen2", "qwen3"):
        folder = out / f"tiny-{arch}"
        names = os.listdir(folder)
        assert {"config.json", "tokenizer.json", "generation_config.json"} <= set(names), names
        assert any(n.endswith(".safetensors") for n in names)
        assert str(folder) in stdout.splitlines()


def test_make_tiny_unknown_kind(tmp_path, capsys):
    with pytest.raises(SystemExit, match="not a tiny model kind"):
        cli.main(["make-tiny", str(tmp_path), "--kind", "nope"])


def test_generate_prints_text(tiny_dir, tmp_path):
    model = str(tiny_dir[0] / "tiny-qwen2")
    want = _greedy(model, "The harbour town", 8)
    r = _run("generate", model, "--prompt", "The harbour town", "--max-tokens", "8", "--device", "cpu",
             "--dtype", "float32", "--no-chat")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"

    target = tmp_path / "out.txt"
    assert cli.main(["generate", model, "--prompt", "The harbour town", "--max-tokens", "8", "--device", "cpu",
                     "--dtype", "float32", "--output", str(target), "--no-chat"]) == 0
    assert target.read_text(encoding="utf-8") == want


def test_generate_answers_an_instruct_model_through_its_chat_template(tiny_dir, capsys):
    from omnistage import Omni, SamplingParams

    model = str(tiny_dir[0] / "tiny-qwen2")
    with Omni(model=model, device="cpu", dtype="float32") as omni:
        want = omni.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=8, temperature=0.0),
                         use_tqdm=False)[0].outputs[0].text
    assert cli.main(["generate", model, "--prompt", "hi", "--max-tokens", "8", "--device", "cpu",
                     "--dtype", "float32"]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_version_help_for_every_flag_and_one_list_of_tiny_kinds(capsys):
    from omnistage import __version__
    from omnistage.testing import TINY_KINDS

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"omnistage {__version__}"
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "serve" in a.choices).choices
    for name, sub in subparsers.items():
        for action in sub._actions:
            assert action.help, f"omnistage {name} {action.option_strings or action.dest} has no help text"
    listed = " | ".join(TINY_KINDS)
    assert listed in " ".join(subparsers["make-tiny"].format_help().split())
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md"), encoding="utf-8").read()
    assert listed in " ".join(readme.split()), "README's make-tiny kinds differ from omnistage.testing.TINY_KINDS"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_device_cuda_without_a_gpu_is_one_line(capsys):
    with pytest.raises(SystemExit) as refused:
        cli.main(["generate", "--prompt", "x", "--device", "cuda"])
    message = str(refused.value)
    assert message.startswith("omnistage: --device cuda: no such GPU; available: cpu only") and "\n" not in message


def test_a_busy_port_is_refused_before_the_model_loads(tmp_path):
    """The folder does not exist: had the model been loaded first, that would be the error."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port} .*pick another --port"):
            cli.main(["serve", str(tmp_path / "no-such-model"), "--port", str(port), "--device", "cpu"])


def test_image_generate_without_output_is_refused_before_it_runs(tmp_path):
    from omnistage.testing import make_tiny

    folder = make_tiny(str(tmp_path), "z-image")[0]
    with pytest.raises(SystemExit, match=r"this model makes images; pass --output FILE\.png"):
        cli.main(["generate", folder, "--prompt", "a cube", "--device", "cpu"])
    assert os.listdir(tmp_path) == [os.path.basename(folder)]


def test_serve_defaults():
    args = cli.build_parser().parse_args(["serve"])
    assert (args.model, args.host, args.port, args.api_key, args.device) == (None, "127.0.0.1", 8000, None, "auto")


def test_serve_boots_and_answers(tiny_dir, tmp_path):
    """Also: the key from a file (not in `ps`) and never printed; the folder's name served, its path in
    no answer (not in /metrics)."""
    model = str(tiny_dir[0] / "tiny-qwen2")
    key = "sk-file-7f3a9c"
    (tmp_path / "key").write_text(key + "\n", encoding="utf-8")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(_cmd("serve", model, "--port", str(port), "--device", "cpu", "--dtype", "float32",
                                 "--api-key-file", str(tmp_path / "key"), "--log-level", "warning"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, encoding="utf-8",
                            env=_env())
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == ["tiny-qwen2"]
            reply = client.chat.completions.create(model="tiny-qwen2", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4)
        assert reply.usage.completion_tokens >= 1
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'model_name="tiny-qwen2"' in metrics and str(tiny_dir[0]) not in metrics
    finally:
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert f"curl http://127.0.0.1:{port}/v1/chat/completions" in output
    # how to authenticate, without the key itself (the banner ends up in logs)
    assert "Authorization: Bearer $OMNISTAGE_API_KEY" in output and "from openai import OpenAI" in output
    assert key not in output


def test_api_key_sources(tmp_path):
    from omnistage.entrypoints.openai.api_server import resolve_api_key

    def key(*flags, env=None):
        return resolve_api_key(cli.build_parser().parse_args(["serve", *flags]), env or {})

    (tmp_path / "key").write_text("from-file\n", encoding="utf-8")
    (tmp_path / "empty").write_text("\n", encoding="utf-8")
    assert key() is None
    assert key(env={"OMNISTAGE_API_KEY": "from-env"}) == "from-env"
    assert key("--api-key-file", str(tmp_path / "key"), env={"OMNISTAGE_API_KEY": "from-env"}) == "from-file"
    assert key("--api-key", "flag", env={"OMNISTAGE_API_KEY": "from-env"}) == "flag"
    for flags, message in ((("--api-key", "a", "--api-key-file", str(tmp_path / "key")), "once"),
                           (("--api-key-file", str(tmp_path / "empty")), "is empty"),
                           (("--api-key-file", str(tmp_path / "missing")), "cannot read")):
        with pytest.raises(SystemExit, match=message):
            key(*flags)
