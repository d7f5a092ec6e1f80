"""`ember generate` and `ember chat`, run through main() as a user would."""
from __future__ import annotations

import io


from ember import cli


def test_generate_streams_greedy_text(tiny_llama_dir, capsys):
    folder, _ = tiny_llama_dir
    from ember import LLM, SamplingParams
    want = LLM(str(folder)).generate("Hello", SamplingParams(temperature=0, max_tokens=8))
    rc = cli.main(["generate", "Hello", "--model", str(folder), "--temperature", "0",
                   "--max-tokens", "8"])
    assert rc == 0
    assert capsys.readouterr().out == want[0].outputs[0].text + "\n"


def test_chat_keeps_the_conversation(tiny_llama_dir, capsys, monkeypatch):
    folder, _ = tiny_llama_dir
    lines = iter(["zebra", "/reset", "quokka", "/exit"])
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    args = cli.build_parser().parse_args(["chat", "--model", str(folder), "--temperature", "0",
                                          "--max-tokens", "4"])
    from ember.engine.llm import LLM
    prompts = []
    real_stream = LLM.stream

    def spy(self, prompt, params=None):
        prompts.append(self.tokenizer.decode(prompt, skip_special_tokens=False))
        return real_stream(self, prompt, params)

    monkeypatch.setattr(LLM, "stream", spy)
    cli.cmd_chat(args, read=lambda _: next(lines))
    assert len(prompts) == 2
    assert "zebra" in prompts[0] and "quokka" in prompts[1] and "zebra" not in prompts[1]


def test_bad_model_path_exits_with_a_clear_error(capsys):
    assert cli.main(["generate", "x", "--model", "/no/such/model.gguf"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bad_sampling_value_exits_with_a_clear_error(tiny_llama_dir, capsys):
    folder, _ = tiny_llama_dir
    assert cli.main(["generate", "x", "--model", str(folder), "--top-p", "2"]) == 2
    assert "top_p=2.0 must be in (0, 1]" in capsys.readouterr().err


def test_perplexity_command_writes_its_result(tiny_llama_dir, tmp_path, capsys):
    import json
    folder, _ = tiny_llama_dir
    out = tmp_path / "ppl.json"
    assert cli.main(["perplexity", "--model", str(folder), "--num-tokens", "300",
                     "--window", "100", "--kv-cache-dtype", "int8", "--out", str(out),
                     "-q"]) == 0
    result = json.loads(out.read_text())
    assert result["tokens_scored"] == 3 * 99 and result["kv_cache_dtype"] == "int8"
    assert result["perplexity"] > 1


def test_perplexity_like_llama_cpp_scores_second_halves_of_whole_windows(tiny_llama_dir,
                                                                         tmp_path):
    """llama-perplexity -c 100 on 350 tokens: 3 whole windows, tokens 51-99 of each."""
    import json
    folder, _ = tiny_llama_dir
    out = tmp_path / "ppl.json"
    assert cli.main(["perplexity", "--model", str(folder), "--num-tokens", "350",
                     "--window", "100", "--like-llama-cpp", "--out", str(out), "-q"]) == 0
    result = json.loads(out.read_text())
    assert result["tokens_scored"] == 3 * 49 and result["scored_from"] == 51
