"""A GGUF's model config and tokenizer, read from its metadata: the config equals transformers' own reading, the
tokenizer is converted once and then read from its cache folder (a damaged copy converted again)."""

from __future__ import annotations

import pytest
from gguf_files import ARCH_KEYS, EOS, tiny_gguf, write_gguf
from transformers import AutoConfig

from engine.weights.gguf_config import FAST_ARCHITECTURES, gguf_config
from engine.weights.gguf_file import read_gguf
from engine.weights.gguf_tokenizer import load_gguf_tokenizer, tokenizer_folder


@pytest.mark.parametrize("arch,name", [(a, "tiny") for a in FAST_ARCHITECTURES if a != "mistral"] +
                         [("llama", "mistral")])
def test_the_config_read_from_the_metadata_equals_transformers(tmp_path, arch, name):
    path = write_gguf(tmp_path / "m.gguf", {}, arch=arch, name=name, metadata=ARCH_KEYS.get(arch))
    ours_config = gguf_config(read_gguf(path))
    theirs = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert type(ours_config) is type(theirs)
    assert ours_config.to_dict() == theirs.to_dict()
    assert (ours_config.model_type == "mistral") == (name == "mistral")


def test_the_tokenizer_is_converted_once_and_then_read_from_the_cache(tmp_path):
    from transformers import AutoTokenizer

    path = tiny_gguf(tmp_path.parent / "q4k.gguf", "Q4_K")
    file = read_gguf(path)
    converted = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    first = load_gguf_tokenizer(file, tmp_path)
    folder = tokenizer_folder(file, tmp_path)
    assert folder.name.startswith(file.metadata_digest)
    assert (folder / "tokenizer.json").is_file()
    chat = [{"role": "user", "content": "hello there"}]
    for tokenizer in (first, load_gguf_tokenizer(file, tmp_path)):
        assert tokenizer("the cat sat on a mat")["input_ids"] == converted("the cat sat on a mat")["input_ids"]
        assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            converted.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) == (EOS, 1, 0)
    template = next(folder.glob("chat_template.jinja"))
    template.write_text("cached {{ messages[0]['content'] }}")
    assert load_gguf_tokenizer(file, tmp_path).apply_chat_template(chat, tokenize=False) == "cached hello there"
    (folder / "tokenizer.json").write_text("{ not json")  # damaged: converted again, and replaced
    again = load_gguf_tokenizer(file, tmp_path)
    assert again("the cat")["input_ids"] == converted("the cat")["input_ids"]
    assert list(tmp_path.iterdir()) == [folder]  # no temporary folder left
    other = read_gguf(write_gguf(tmp_path.parent / "other.gguf", {}, name="other"))  # other metadata: another key
    assert other.metadata_digest != file.metadata_digest
