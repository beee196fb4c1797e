"""Token-preserving recovery: a request taken over from a dead worker continues from the tokens its readers
were already shown (prompt + shown tokens, the budget less them, output numbered after them), so a reader
sees one sequence with nothing replayed, equal to a run with no crash. The end-to-end case, a SIGKILLed
worker process, is tests/test_service_process.py's; here, where a rerun may pick up."""

from __future__ import annotations

from specserve.service.running import resume_point


def test_resume_point_takes_the_tokens_whose_text_was_shown(demo_tokenizer):
    tok = demo_tokenizer
    prompt = tok.encode("Say it:")
    ids = tok.encode(" héllo wörld, ok")
    full = tok.decode(ids)
    assert resume_point(tok, prompt, ids, full) == (len(ids), len(full))
    # the reader saw the ids but not all their text (held back: it could still become a stop string)
    n, chars = resume_point(tok, prompt, ids, full[:-4])
    assert n < len(ids) and full[:chars] == tok.decode(ids[:n]) and chars <= len(full) - 4
    # half a UTF-8 character: a token that is only the first byte of "é" has no text of its own yet
    e_bytes = [t for t in tok.encode("é") if tok.decode([t]) == "\ufffd"]
    if e_bytes:
        ids2 = tok.encode(" caf") + e_bytes[:1]
        shown = tok.decode(ids2[:-1])
        assert resume_point(tok, prompt, ids2, shown) == (len(ids2) - 1, len(shown))
    assert resume_point(tok, prompt, [], "") == (0, 0)
