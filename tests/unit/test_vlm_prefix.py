"""The prefix cache with images (issue #40): a block's hash takes the digests of the images whose tokens it
holds, so the same image and text reuse the KV, and another image of the same size (the same token ids)
misses from its first image block on; the hash chain and the salt keep their meaning."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path

import numpy as np
import pytest
from block_harness import BlockRunner, step
from block_harness import prompt as harness_prompt
from fakes import make_seq

from helpers.tiny_vlm import FAMILIES
from helpers.vlm_serving import chat, config, image_of, processed, prompt_of, reference, same, serve
from lmiserve.engine.core.block_scheduler import BlockScheduler
from lmiserve.engine.core.kv_blocks import BlockPool, BlockTable, block_hash, root_hash
from lmiserve.engine.factory import create_engine
from lmiserve.engine.loaded import LoadedModel
from lmiserve.engine.runner.vision import image_token_id
from lmiserve.engine.text.images import ImageInputs, ImageSpan, chunk_length, span_digests
from lmiserve.models.load import load_causal_lm

BLOCK = 4


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request, tiny_vlm_dir) -> tuple[str, Path, LoadedModel]:
    family = request.param
    path = tiny_vlm_dir(family)
    return family, path, load_causal_lm(path, dtype="fp32", device="cpu")


def test_the_same_image_hits_another_misses(vlm):
    family, path, loaded = vlm
    prompt = prompt_of(loaded, chat("Describe the picture in a few words."))
    same_image, other_image = (image_of(7),), (image_of(8),)  # one size: the same token ids
    ids = processed(loaded, prompt, same_image)
    assert ids == processed(loaded, prompt, other_image)
    first_image_block = ids.index(image_token_id(loaded.model)) // BLOCK * BLOCK
    requests = [(prompt, same_image), (prompt, same_image), (prompt, other_image)]
    results, _ = asyncio.run(serve(loaded, config(block_size=BLOCK), requests, one_by_one=True))
    (_, cold), (_, warm), (_, other) = results
    assert cold == 0
    assert warm == (len(ids) - 1) // BLOCK * BLOCK, family  # every full block but the prompt's last token's
    assert other == first_image_block, family  # the text before the image only
    assert same(results, [reference(path, p, im) for p, im in requests]), family


def test_block_hashes_take_the_images_digests():
    root = root_hash(None)
    tokens = [1, 2, 3, 4]
    assert block_hash(root, tokens) == block_hash(root, tokens, ())  # text blocks hash as before
    assert block_hash(root, tokens, ["a"]) != block_hash(root, tokens, ["b"]) != block_hash(root, tokens)
    spans = (ImageSpan(2, 5, "a"), ImageSpan(9, 2, "b"))
    assert span_digests(spans, 0, 4) == ["a"]
    assert span_digests(spans, 4, 8) == ["a"]
    assert span_digests(spans, 8, 12) == ["b"]
    assert span_digests(spans, 12, 16) == [] and span_digests(None, 0, 4) == []


def test_the_pool_matches_only_the_same_images_under_the_same_salt():
    pool = BlockPool(16, block_size=4)
    tokens = list(range(13))
    mine, theirs = (ImageSpan(4, 6, "img-1"),), (ImageSpan(4, 6, "img-2"),)
    table = BlockTable()
    assert pool.allocate(table, len(tokens))
    assert pool.cache_full_blocks(table, tokens, "salt", images=mine) == 3
    assert pool.match_prefix(tokens, "salt", images=mine).num_cached_tokens == 12
    assert pool.match_prefix(tokens, "salt", images=theirs).num_cached_tokens == 4  # the block before the image
    assert pool.match_prefix(tokens, "other", images=mine).num_cached_tokens == 0
    assert pool.match_prefix(tokens, "salt").num_cached_tokens == 4  # text only: the image's ids are not enough
    pool.check([table])


def test_a_chunk_never_ends_inside_an_atomic_image():
    atomic = ImageInputs({}, 9, (ImageSpan(10, 16, "x"),), atomic=True)
    assert chunk_length(atomic, 0, 5) == 5  # before the image
    assert chunk_length(atomic, 5, 8) == 5  # would end inside: ends before it
    assert chunk_length(atomic, 10, 5) == 16  # starts at it: takes it whole, past the budget
    assert chunk_length(atomic, 14, 5) == 12  # starts inside (a cached head): to its end
    assert chunk_length(atomic, 26, 5) == 5
    plain = ImageInputs({}, 9, (ImageSpan(10, 16, "x"),))
    assert chunk_length(plain, 5, 8) == 8 and chunk_length(None, 5, 8) == 8


def test_a_second_image_that_differs_misses_from_its_own_blocks(vlm):
    family, path, loaded = vlm
    prompt = prompt_of(loaded, chat("Compare the two pictures.", images=2))
    first, second = (image_of(7), image_of(8)), (image_of(7), image_of(9))
    ids = processed(loaded, prompt, first)
    assert ids == processed(loaded, prompt, second)
    token = image_token_id(loaded.model)
    spans = engine_spans(loaded, prompt, first)
    results, _ = asyncio.run(
        serve(loaded, config(block_size=BLOCK), [(prompt, first), (prompt, second)], one_by_one=True)
    )
    # the blocks before the first block that holds the second image's tokens are shared (Idefics3's tiles
    # make one span of both images: only the text before them)
    assert results[1][1] == spans[-1].offset // BLOCK * BLOCK, (family, [(s.offset, s.length) for s in spans])
    assert len(spans) == 2 or family == "idefics3"
    assert ids.count(token) > 0
    assert same(results, [reference(path, prompt, first), reference(path, prompt, second)]), family


def engine_spans(loaded: LoadedModel, prompt: str, images) -> tuple[ImageSpan, ...]:
    codec = create_engine(loaded, config()).codec
    assert codec.images is not None
    found = codec.images.encode(prompt, images).images
    assert found is not None
    return found.spans


def test_the_scheduler_never_ends_a_chunk_inside_an_atomic_image_and_sends_the_images():
    pool = BlockPool(32, block_size=4)
    sched = BlockScheduler(pool, max_prefill_tokens=5, prefill_floor=None)
    runner = BlockRunner(sched)
    images = ImageInputs({"pixel_values": np.zeros((1, 3, 2, 2), np.float32)}, 9, (ImageSpan(7, 9, "x"),), atomic=True)
    seq = make_seq(harness_prompt(24), max_new_tokens=3)
    seq.images = images
    sched.add(seq)
    ends, sent = [], []
    while sched.has_work():
        plan, _ = step(sched, runner)
        ends += [c.start + c.length for c in plan.prefill]
        sent += [new.images for new in plan.batch.new]
    assert ends == [5, 7, 16, 21, 24]  # 7..15 in one chunk, past the budget
    assert sent == [images]
    assert pickle.loads(pickle.dumps(images)).spans == images.spans
