"""GGUF model files: ``p2prl model import``, ``model.path`` naming a ``.gguf`` file, and what is refused, on a tiny
GGUF written here (tests/helpers/tiny_gguf.py; the real SmolLM2 file is tests/e2e/test_smollm2.py's)."""

import sys

import pytest
import torch

pytest.importorskip("gguf", reason="the gguf package (extra [gguf], in [test]) is not installed")

from p2prl.cli import main  # noqa: E402
from p2prl.config import TaskConfig  # noqa: E402
from p2prl.policy import PolicyLoadError, load_policy  # noqa: E402
from p2prl.policy.gguf import GGUFError, import_gguf, load_gguf  # noqa: E402
from p2prl.policy.model import model_folder, model_hash  # noqa: E402
from p2prl.tasks import TaskError, make_task, render_prompt  # noqa: E402
from helpers.tiny_gguf import write_tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_import_writes_a_plain_folder_with_the_same_logits(tiny, tmp_path):
    out = tmp_path / "model"
    assert import_gguf(tiny, out) == 0.0
    names = {f.name for f in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "quantization_config" not in (out / "config.json").read_text()
    policy = load_policy(out)
    assert type(policy.model).__name__ == "LlamaForCausalLM" and policy.model.config.head_dim == 32
    text = policy.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert policy.tokenizer.decode(policy.tokenizer("hello there").input_ids) == "hello there"
    gguf_model, tokenizer = load_gguf(tiny)
    ids = torch.tensor([tokenizer("the cat sat").input_ids])
    with torch.no_grad():
        assert torch.equal(policy.model(ids).logits, gguf_model(ids).logits)
    with pytest.raises(GGUFError, match="exists"):
        import_gguf(tiny, out)


def test_model_path_may_name_a_gguf_file(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("P2PRL_CACHE", str(tmp_path / "cache"))
    folder = model_folder(str(tiny))
    assert folder.parent == tmp_path / "cache" / "gguf" and (folder / "model.safetensors").is_file()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    policy = load_policy(str(tiny))  # imported once: the cached folder loads
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert policy.model.name_or_path == str(folder) and model_hash(str(tiny)) == model_hash(str(folder))


def test_an_architecture_transformers_cannot_dequantize_is_refused_with_the_list(tmp_path, monkeypatch):
    odd = write_tiny_gguf(tmp_path / "odd.gguf", architecture="rwkv7")
    with pytest.raises(GGUFError, match=r"rwkv7.*architectures .*llama.*qwen2"):
        import_gguf(odd, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    monkeypatch.setenv("P2PRL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(PolicyLoadError, match=r"model.path=.*rwkv7"):
        load_policy(str(odd))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(PolicyLoadError, match="not a readable GGUF file"):
        load_policy(str(tmp_path / "junk.gguf"))
    with pytest.raises(PolicyLoadError, match="no GGUF file"):
        load_policy(str(tmp_path / "absent.gguf"))


def test_a_gguf_without_chat_template_is_refused_where_one_is_required(tmp_path, monkeypatch):
    monkeypatch.setenv("P2PRL_CACHE", str(tmp_path / "cache"))
    plain = load_policy(str(write_tiny_gguf(tmp_path / "plain.gguf", chat_template=False)))
    task = make_task(TaskConfig(name="math", path="builtin", chat_template="always"))
    with pytest.raises(TaskError, match=r"has none; use a chat model \(a folder or \.gguf file.*'never'"):
        render_prompt(plain.tokenizer, task, task.problem(0))
    never = make_task(TaskConfig(name="math", path="builtin", chat_template="never"))
    assert render_prompt(plain.tokenizer, never, never.problem(0))


def test_without_the_gguf_package_the_fix_is_named(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(GGUFError, match=r"pip install -e '\.\[gguf\]'"):
        import_gguf(tiny, tmp_path / "out")


def test_cli_model_import(tiny, tmp_path, capsys):
    assert main(["model", "import", str(tiny), str(tmp_path / "m")]) == 0
    assert "logits match" in capsys.readouterr().out and (tmp_path / "m" / "config.json").is_file()
    assert main(["model", "import", str(tmp_path / "absent.gguf"), str(tmp_path / "n")]) == 2
    assert "no GGUF file" in capsys.readouterr().err
