"""CompletionOutput: EOS, max_new_tokens, stop strings, and tokens after the finish."""
from __future__ import annotations

import pytest

from gateway.output import Chunk, CompletionOutput, Finish


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def make_output(tokenizer, max_new_tokens: int = 100, stop: list[str] | None = None,
                prompt: str = "Hello") -> CompletionOutput:
    return CompletionOutput(tokenizer, encode(tokenizer, prompt), max_new_tokens, stop or [],
                            [tokenizer.eos_token_id])


def test_stops_at_eos(tokenizer):
    out = make_output(tokenizer)
    ids = encode(tokenizer, " world")
    chunk = out.add(ids + [tokenizer.eos_token_id] + encode(tokenizer, " more"))
    assert chunk == Chunk(token_ids=ids, text=" world", finish=Finish.EOS)
    assert out.finish is Finish.EOS
    assert out.num_tokens == len(ids)  # EOS not counted


def test_eos_first(tokenizer):
    out = make_output(tokenizer)
    chunk = out.add([tokenizer.eos_token_id, 50, 51])
    assert chunk == Chunk(token_ids=[], text="", finish=Finish.EOS)
    assert out.num_tokens == 0


def test_eos_does_not_count_towards_max(tokenizer):
    ids = encode(tokenizer, " world")
    out = make_output(tokenizer, max_new_tokens=len(ids) + 1)
    chunk = out.add(ids + [tokenizer.eos_token_id])
    assert chunk.finish is Finish.EOS
    assert out.num_tokens == len(ids)


def test_several_eos_ids(tokenizer):
    other_eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    out = CompletionOutput(tokenizer, [], 100, [], [tokenizer.eos_token_id, other_eos])
    chunk = out.add(encode(tokenizer, "ab") + [other_eos])
    assert chunk.finish is Finish.EOS
    assert chunk.text == "ab"


def test_stops_at_max_new_tokens_exactly(tokenizer):
    ids = encode(tokenizer, " world and more")
    out = make_output(tokenizer, max_new_tokens=3)
    chunk = out.add(ids)
    assert chunk.token_ids == ids[:3]
    assert chunk.finish is Finish.LENGTH
    assert chunk.text == tokenizer.decode(ids[:3])
    assert out.num_tokens == 3


def test_max_new_tokens_across_calls(tokenizer):
    ids = encode(tokenizer, " world and more")
    out = make_output(tokenizer, max_new_tokens=4)
    first = out.add(ids[:3])
    assert first.finish is None
    assert first.token_ids == ids[:3]
    second = out.add(ids[3:])
    assert second.token_ids == ids[3:4]
    assert second.finish is Finish.LENGTH
    assert first.text + second.text == tokenizer.decode(ids[:4])


def test_max_new_tokens_one(tokenizer):
    out = make_output(tokenizer, max_new_tokens=1)
    chunk = out.add([70, 71, 72])
    assert chunk.token_ids == [70]
    assert chunk.finish is Finish.LENGTH


def test_length_mid_character_flushes_like_full_decode(tokenizer):
    ids = encode(tokenizer, " 🙂")
    assert len(ids) > 1
    out = make_output(tokenizer, max_new_tokens=len(ids) - 1)
    chunk = out.add(ids)
    assert chunk.finish is Finish.LENGTH
    assert chunk.text == tokenizer.decode(ids[:-1])  # the truncated character, as decode shows it


@pytest.mark.parametrize("ends_on", ["length", "eos"])
def test_stop_string_in_the_text_flushed_at_the_end_is_a_stop(tokenizer, ends_on):
    # generation ends mid-character: the detokenizer held the partial bytes back until the end, and
    # only then does the flushed text show the stop string (here one ending in the replacement character)
    ids = encode(tokenizer, " ok 🙂")
    assert len(ids) > 3
    cut = ids[:-1]  # the emoji's first bytes only
    flushed = tokenizer.decode(cut)
    assert flushed.endswith("\ufffd")
    stop = flushed[-2:]
    out = make_output(tokenizer, max_new_tokens=len(cut) if ends_on == "length" else 100, stop=[stop])
    chunk = out.add(cut + ([tokenizer.eos_token_id] if ends_on == "eos" else []))
    assert chunk.finish is Finish.STOP
    assert chunk.text == flushed[:flushed.index(stop)]


def test_stops_at_stop_string(tokenizer):
    ids = encode(tokenizer, " world. The end")
    out = make_output(tokenizer, stop=["."])
    chunk = out.add(ids)
    assert chunk.finish is Finish.STOP
    assert chunk.text == " world"
    assert chunk.token_ids == ids[: len(encode(tokenizer, " world."))]
    assert out.num_tokens == len(chunk.token_ids)


def test_stop_string_across_tokens_and_calls(tokenizer):
    ids = encode(tokenizer, " quick brown fox jumps")
    out = make_output(tokenizer, stop=["brown"])
    texts, finish = [], None
    for token_id in ids:
        chunk = out.add([token_id])
        texts.append(chunk.text)
        if chunk.finish:
            finish = chunk.finish
            break
    assert finish is Finish.STOP
    assert "".join(texts) == " quick "


def test_stop_string_with_multibyte_text(tokenizer):
    ids = encode(tokenizer, " 東京🙂 北京")
    out = make_output(tokenizer, stop=["🙂"])
    chunk = out.add(ids)
    assert chunk.finish is Finish.STOP
    assert chunk.text == " 東京"


def test_stop_string_beats_length_on_same_token(tokenizer):
    ids = encode(tokenizer, " world.")
    out = make_output(tokenizer, max_new_tokens=len(ids), stop=["."])
    chunk = out.add(ids)
    assert chunk.finish is Finish.STOP
    assert chunk.text == " world"


def test_held_text_released_at_eos(tokenizer):
    ids = encode(tokenizer, " wor")
    out = make_output(tokenizer, stop=["world"])
    first = out.add(ids)
    assert first.finish is None
    assert first.text == " "  # "wor" might begin "world"
    last = out.add([tokenizer.eos_token_id])
    assert last.finish is Finish.EOS
    assert first.text + last.text == " wor"


def test_held_text_released_at_length(tokenizer):
    ids = encode(tokenizer, " wor")
    out = make_output(tokenizer, max_new_tokens=len(ids), stop=["world"])
    chunk = out.add(ids)
    assert chunk.finish is Finish.LENGTH
    assert chunk.text == " wor"


def test_ignores_committed_tokens_after_finish(tokenizer):
    out = make_output(tokenizer, max_new_tokens=2)
    chunk = out.add([70, 71, 72, 73])
    assert chunk.token_ids == [70, 71]
    assert out.num_tokens == 2
    with pytest.raises(AssertionError):
        out.add([74])


def test_unfinished_chunks_stream_full_text(tokenizer):
    text = " 東京 and 北京 🙂🚀 café"
    ids = encode(tokenizer, text)
    out = make_output(tokenizer)
    streamed = ""
    for i in range(0, len(ids), 2):
        chunk = out.add(ids[i:i + 2])
        assert chunk.finish is None
        assert "\ufffd" not in chunk.text
        streamed += chunk.text
    chunk = out.add([tokenizer.eos_token_id])
    assert streamed + chunk.text == text
    assert out.num_tokens == len(ids)


def test_completion_after_cjk_prompt_byte_fallback(sp_tokenizer):
    prompt_ids = encode(sp_tokenizer, "東京")
    ids = encode(sp_tokenizer, "東京é!")[len(prompt_ids):]  # [<0xC3>, <0xA9>, "!"]
    out = CompletionOutput(sp_tokenizer, prompt_ids, 100, [], [sp_tokenizer.eos_token_id])
    chunk = out.add(ids + [sp_tokenizer.eos_token_id])
    assert chunk.finish is Finish.EOS
    assert chunk.text == "é!"
