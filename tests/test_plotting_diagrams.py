"""The diagrams drawn at run time: chapter 11's data-parallel step and chapter 12's tensor-name map.

The data-parallel picture is checked against a ring all-reduce simulated here; the name map against the package's
loaders run on checkpoints that `transformers` writes, and against the `gguf` package's own table of llama.cpp
names."""

import dataclasses

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from groundup.plotting import loader_conversions, plot_data_parallel, plot_tensor_names, tensor_name_rows  # noqa: E402


def texts(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def chunk_ids(fig):
    """{(stage, process): [number of colours of chunk 0, 1, ...]} from the chunks' ids."""
    found = {}
    for patch in fig.axes[0].patches:
        gid = patch.get_gid()
        if gid:
            stage, process, chunk, colours = gid.split(":")
            found.setdefault((stage, int(process)), {})[int(chunk)] = int(colours)
    return {key: [chunks[k] for k in sorted(chunks)] for key, chunks in found.items()}


def ring_reduce_scatter(p):
    """Which processes' numbers each chunk holds after the ring's p - 1 reduce-scatter steps (Exercise 11.1's ring:
    process r sends chunk (r - step) mod p to process r + 1, which adds it), as sets, process r = 0 … p - 1."""
    held = [[{r} for _ in range(p)] for r in range(p)]  # held[r][c]: whose numbers process r's chunk c sums
    for step in range(p - 1):
        messages = [(r, (r - step) % p, set(held[r][(r - step) % p])) for r in range(p)]
        for r, c, data in messages:
            held[(r + 1) % p][c] |= data
    return held


@pytest.mark.parametrize("p", [2, 3, 4])
def test_data_parallel_shows_the_ring_as_simulated(p):
    fig = plot_data_parallel(p)
    ids = chunk_ids(fig)
    held = ring_reduce_scatter(p)
    for r in range(p):
        assert ids[("gradient", r + 1)] == [1] * p, "each local gradient: p chunks of its own process's colour"
        full = [len(s) == p for s in held[r]]
        assert sum(full) == 1
        expected = [p if f else 0 for f in full]  # the summed chunk striped with p colours, the rest grey
        assert ids[("reduce-scatter", r + 1)] == expected, f"process {r + 1} after reduce-scatter"
        assert ids[("all-gather", r + 1)] == [p] * p, "after the all-gather every chunk is the full sum"
    shown = texts(fig)
    assert [f"shard $S_{r}$: $B/p$ rows" for r in range(1, p + 1)] == [t for t in shown if t.startswith("shard")]
    assert sum(t.startswith("process ") for t in shown) == p
    assert sum("(11.3)" in t for t in shown) == p and any("(11.5)" in t for t in shown)
    assert any(f"$p = {p}$" in t for t in shown)
    assert fig.get_size_inches()[0] == pytest.approx(6.8)
    plt.close(fig)


def test_data_parallel_refuses_a_bad_process_count():
    for bad in (1, 7, 2.0, True, "3"):
        with pytest.raises(ValueError, match="n_processes must be an integer from 2 to 6"):
            plot_data_parallel(bad)


# ---- chapter 12: the tensor-name map ---------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
gguf_constants = pytest.importorskip("gguf.constants")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """GPT-2 and LLaMA checkpoints written by transformers (random, tiny), each: (its tensors, our loader's
    state, our loader's name table), and the GGUF table for the same LLaMA."""
    from groundup.pretrained import gguf_tensor_names, gpt2_config, gpt2_state_dict, llama_config, llama_state_dict

    torch.manual_seed(0)
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                   bos_token_id=0, eos_token_id=0)
    llama = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=88, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    found = {}
    for name, config, model_class in (("gpt2", gpt2, transformers.GPT2LMHeadModel),
                                      ("llama", llama, transformers.LlamaForCausalLM)):
        folder = tmp_path_factory.mktemp(name)
        model_class(config).save_pretrained(folder)
        found[name] = safetensors_torch.load_file(folder / "model.safetensors")
    gpt2_state, gpt2_names = gpt2_state_dict(dict(found["gpt2"]), gpt2_config(gpt2.to_dict()))
    ours_llama = llama_config(llama.to_dict())
    llama_state, llama_names = llama_state_dict(dict(found["llama"]), ours_llama)
    gguf_names = gguf_tensor_names(dataclasses.replace(ours_llama, rope_pairing="interleaved"))
    return {"gpt2": (found["gpt2"], gpt2_state, {k: "transformer." + v for k, v in gpt2_names.items()}),
            "llama": (found["llama"], llama_state, llama_names), "gguf": gguf_names}


def columns_of(checkpoints):
    return {"GPT-2 (Hugging Face)": checkpoints["gpt2"][2], "LLaMA (Hugging Face)": checkpoints["llama"][2],
            "GGUF (llama.cpp)": checkpoints["gguf"]}


@pytest.mark.parametrize("layer", [0, 1])
def test_rows_are_the_loaders_tables(checkpoints, layer):
    columns = columns_of(checkpoints)
    rows, prefixes, suffixes = tensor_name_rows(columns, layer=layer)
    assert prefixes == {"GPT-2 (Hugging Face)": f"transformer.h.{layer}.",
                        "LLaMA (Hugging Face)": f"model.layers.{layer}.", "GGUF (llama.cpp)": f"blk.{layer}."}
    assert suffixes == {"GPT-2 (Hugging Face)": (".weight", ".bias"), "LLaMA (Hugging Face)": (".weight",),
                        "GGUF (llama.cpp)": (".weight",)}
    assert [module for module, _ in rows] == ["norm_1", "attention.W_q", "attention.W_k", "attention.W_v",
                                              "attention.W_o", "norm_2", "ffn.W_gate", "ffn.W_in", "ffn.W_out"]
    for (column, table), k in zip(columns.items(), range(3)):
        block = {ours for ours in table if ours.startswith(f"blocks.{layer}.")}
        drawn = set()
        for module, names in rows:
            for suffix in suffixes[column]:
                ours = f"blocks.{layer}.{module}{suffix}"
                if names[k] is None:
                    assert ours not in table
                else:
                    assert table[ours] == prefixes[column] + names[k] + suffix
                    drawn.add(ours)
        assert drawn == block, f"{column}: every tensor of the block is in a row"
    gpt2_tensors, llama_tensors = checkpoints["gpt2"][0], checkpoints["llama"][0]
    for _module, (gpt2, llama, gguf) in rows:  # the names are the checkpoints' and llama.cpp's own
        assert gpt2 is None or f"transformer.h.{layer}.{gpt2}.weight" in gpt2_tensors
        assert f"model.layers.{layer}.{llama}.weight" in llama_tensors
        llama_cpp = {gguf_constants.TENSOR_NAMES[t].format(bid=layer)
                     for t in gguf_constants.MODEL_TENSORS[gguf_constants.MODEL_ARCH.LLAMA]}
        assert f"blk.{layer}.{gguf}" in llama_cpp


def test_the_figure_draws_the_rows_and_the_notes(checkpoints):
    columns = columns_of(checkpoints)
    tensors, state, names = checkpoints["gpt2"]
    notes = {"GPT-2 (Hugging Face)": loader_conversions(state, tensors, names),
             "GGUF (llama.cpp)": {"attention.W_q": "rows\npermuted", "attention.W_k": "rows\npermuted"}}
    fig = plot_tensor_names(columns, notes=notes)
    shown = texts(fig)
    rows, _, _ = tensor_name_rows(columns)
    for module, names_in_row in rows:
        assert module in shown
        for name in names_in_row:
            assert name is None or name in shown
    assert shown.count("attn.c_attn") == 1, "c_attn holds W_Q, W_K, W_V: one box"
    assert shown.count("(none)") == 1, "GPT-2 has no W_gate"
    assert shown.count("transposed") == 3 and shown.count("split,\ntransposed") == 1
    assert shown.count("rows\npermuted") == 2
    assert {"transformer.h.$\\ell$.", "model.layers.$\\ell$.", "blk.$\\ell$.", "blocks.$\\ell$."} <= set(shown)
    assert fig.get_size_inches()[0] == pytest.approx(6.8)
    plt.close(fig)


def test_loader_conversions_are_read_from_the_values(checkpoints):
    tensors, state, names = checkpoints["gpt2"]
    found = loader_conversions(state, tensors, names)
    assert found["blocks.0.attention.W_q.weight"] == "split, transposed"
    assert found["blocks.1.attention.W_v.bias"] == "split"
    assert found["blocks.0.attention.W_o.weight"] == "transposed"  # square: only the values tell
    assert found["blocks.0.ffn.W_in.weight"] == found["blocks.0.ffn.W_out.weight"] == "transposed"
    assert found["blocks.0.norm_1.weight"] == found["token_embedding.weight"] == ""
    tensors, state, names = checkpoints["llama"]
    assert set(loader_conversions(state, tensors, names).values()) == {""}
    wrong = dict(state, **{"blocks.0.attention.W_q.weight": -state["blocks.0.attention.W_q.weight"]})
    with pytest.raises(ValueError, match="blocks.0.attention.W_q.weight is not .* copied, transposed or sliced"):
        loader_conversions(wrong, tensors, names)


def test_bad_tables_are_refused_with_what_is_wrong(checkpoints):
    columns = columns_of(checkpoints)
    with pytest.raises(ValueError, match="at least one loader table"):
        tensor_name_rows({})
    with pytest.raises(ValueError, match="has no tensor of block 5"):
        tensor_name_rows(columns, layer=5)
    mixed = dict(checkpoints["gpt2"][2], **{"blocks.0.norm_1.bias": "transformer.h.0.ln_2.bias"})
    with pytest.raises(ValueError, match="norm_1's weight and bias come from different tensors"):
        tensor_name_rows({"GPT-2": mixed})
    with pytest.raises(ValueError, match="notes names columns that columns lacks"):
        plot_tensor_names(columns, notes={"BERT": {}})
    with pytest.raises(ValueError, match="left must be an integer from 0 to the number of columns"):
        plot_tensor_names(columns, left=4)
