"""Tiny random BERT / RoBERTa / XLM-RoBERTa models saved as HF directories, with tokenizers
trained here (no hub access): a WordPiece one for BERT ([CLS] a [SEP] b [SEP], token types
0/1) and a byte-level BPE one for the RoBERTa family (<s> a </s></s> b </s>, no token types).

Weights are drawn with std 0.08 (LayerNorm weights around 1) rather than HF's 0.02, so hidden
states and classifier logits are far from flat. HF transformers in fp32 is the oracle.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

# kind -> (HF architecture, tokenizer family)
KINDS: dict[str, tuple[str, str]] = {
    "bert": ("BertModel", "wordpiece"),
    "bert-cls": ("BertForSequenceClassification", "wordpiece"),
    "roberta": ("RobertaModel", "bpe"),
    "roberta-cls": ("RobertaForSequenceClassification", "bpe"),
    "xlm-roberta": ("XLMRobertaModel", "bpe"),
    "xlm-roberta-cls": ("XLMRobertaForSequenceClassification", "bpe"),
}
# Classifier outputs: one label makes a cross-encoder (vLLM scores only those: a sigmoid of
# the logit), three a classifier (a softmax over them).
NUM_LABELS = {"bert-cls": 1, "roberta-cls": 3, "xlm-roberta-cls": 1}

NUM_LAYERS = 4

CORPUS = [
    "The capital of France is Paris, a city on the Seine.",
    "Berlin is the capital of Germany and its largest city.",
    "Pipeline parallelism splits the layers of a model over several workers.",
    "A cross-encoder reads the query and the document together and scores the pair.",
    "Embeddings map a sentence to a vector; similar sentences land close together.",
    "The quick brown fox jumps over the lazy dog.",
    "Retrieval augmented generation fetches passages before answering a question.",
    "Tokenizers split text into word pieces: unbelievable becomes un ##believ ##able.",
    "In a hole in the ground there lived a hobbit.",
    "What is the tallest mountain on Earth? Mount Everest is 8849 metres high.",
    "1 2 3 4 5 6 7 8 9 10 11 12",
]

# Sentences of different lengths (a batch packs them back to back).
SENTENCES = [
    "What is the capital of France?",
    "Paris",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Pipeline parallelism splits layers over workers.",
    "A",
    "Embeddings map a sentence to a vector.",
]

QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital of France.",
    "Berlin is the capital of Germany.",
    "The quick brown fox jumps over the lazy dog.",
    "France is a country in Europe; its capital city is Paris on the Seine.",
]


def build_wordpiece_tokenizer(out_dir: str) -> Any:
    """A BERT WordPiece tokenizer (lower case) trained on CORPUS, saved to `out_dir`."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import BertTokenizer

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    raw = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    raw.normalizer = normalizers.BertNormalizer(lowercase=True)
    raw.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials)
    raw.train_from_iterator(CORPUS, trainer)
    tokenizer = BertTokenizer(vocab=raw.get_vocab(), do_lower_case=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def build_bpe_tokenizer(out_dir: str) -> Any:
    """A RoBERTa byte-level BPE tokenizer trained on CORPUS (<s>=0, <pad>=1, </s>=2 as in
    RoBERTa), saved to `out_dir`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import RobertaTokenizer

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(CORPUS, trainer)
    model = json.loads(raw.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = RobertaTokenizer(vocab=model["vocab"], merges=merges)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def encoder_config(kind: str, tokenizer: Any, num_layers: int = NUM_LAYERS) -> Any:
    """The HF config of a tiny model of `kind` for `tokenizer`'s vocabulary."""
    from transformers import BertConfig, RobertaConfig, XLMRobertaConfig

    arch, family = KINDS[kind]
    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        hidden_act="gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=tokenizer.pad_token_id,
        architectures=[arch],
    )
    if kind in NUM_LABELS:
        labels = [f"LABEL_{i}" for i in range(NUM_LABELS[kind])]
        common["id2label"] = dict(enumerate(labels))
        common["label2id"] = {label: i for i, label in enumerate(labels)}
    if family == "wordpiece":
        return BertConfig(max_position_embeddings=128, type_vocab_size=2, **common)
    # RoBERTa's positions start at padding_idx + 1: the table holds pad + 1 more rows.
    config_cls = XLMRobertaConfig if kind.startswith("xlm") else RobertaConfig
    return config_cls(
        max_position_embeddings=130,
        type_vocab_size=1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **common,
    )


def randomize(model: torch.nn.Module, seed: int) -> None:
    """std 0.08 weights and biases; LayerNorm weights 1 + 0.1 * N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=gen))


def build_encoder(kind: str, out_dir: str, tokenizer_dir: str, seed: int = 0) -> str:
    """Create, randomise and save a tiny model of `kind` with the tokenizer in `tokenizer_dir`."""
    import transformers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = encoder_config(kind, tokenizer)
    model_cls = getattr(transformers, KINDS[kind][0])
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    randomize(model, seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def encoder_dirs(root: str, kinds: Any = tuple(KINDS)) -> dict[str, str]:
    """Build (once per root) both tokenizers and the tiny models; kind -> directory."""
    tokenizer_dirs = {
        "wordpiece": os.path.join(root, "tokenizer-wordpiece"),
        "bpe": os.path.join(root, "tokenizer-bpe"),
    }
    builders = {"wordpiece": build_wordpiece_tokenizer, "bpe": build_bpe_tokenizer}
    dirs = {}
    for kind in kinds:
        family = KINDS[kind][1]
        if not os.path.isdir(tokenizer_dirs[family]):
            builders[family](tokenizer_dirs[family])
        path = os.path.join(root, kind)
        if not os.path.isdir(path):
            build_encoder(kind, path, tokenizer_dirs[family])
        dirs[kind] = path
    return dirs


def load_hf(model_dir: str) -> Any:
    """The HF model of a saved directory (its architecture), fp32, eval mode: the oracle."""
    import transformers
    from transformers import AutoConfig

    arch = AutoConfig.from_pretrained(model_dir).architectures[0]
    return getattr(transformers, arch).from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_outputs(
    model: Any, tokenizer: Any, encodings: list[dict[str, list[int]]]
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """HF's forward of the encodings as one right-padded batch with its attention_mask: the
    last hidden states [L, hidden] of each (its own rows), and the classifier's logits
    [N, num_labels] of a *ForSequenceClassification model (else None)."""
    batch = tokenizer.pad(encodings, padding=True, return_tensors="pt")
    with torch.inference_mode():
        out = model(**batch, output_hidden_states=True)
    last = out.hidden_states[-1] if hasattr(out, "logits") else out.last_hidden_state
    hidden = [last[i, : len(enc["input_ids"])] for i, enc in enumerate(encodings)]
    return hidden, getattr(out, "logits", None)
