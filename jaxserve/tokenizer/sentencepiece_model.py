"""A sentencepiece BPE tokenizer.model read as a vocabulary and merges, the way transformers converts it.

Parsing the model file needs `protobuf` (sentencepiece ships the message definitions but not the runtime);
only directories without a tokenizer.json come here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

# sentencepiece's ModelProto piece types and trainer model types.
CONTROL = 3
USER_DEFINED = 4
BPE_MODEL = 2


@dataclasses.dataclass(frozen=True)
class SentencePieceModel:
    """Invariant: `vocab` maps every piece to its id (ids 0..n-1, sentencepiece's order, which for BPE is merge
    order); `added_pieces` are the control (special=True) and user-defined (special=False) pieces in id order,
    which must be matched whole rather than merged."""

    vocab: dict[str, int]
    merges: list[tuple[str, str]]
    added_pieces: tuple[tuple[str, bool], ...]


def read_sentencepiece_model(path: Path) -> SentencePieceModel:
    proto = parse_model_proto(path.read_bytes())
    if proto.trainer_spec.model_type != BPE_MODEL:
        raise ValueError(f"{path} is not a sentencepiece BPE model (Llama/Mistral style); only BPE models are "
                         "supported without a tokenizer.json")
    vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
    added = tuple((p.piece, p.type == CONTROL) for p in proto.pieces if p.type in (CONTROL, USER_DEFINED))
    return SentencePieceModel(vocab=vocab, merges=merges_from_vocab(vocab), added_pieces=added)


def parse_model_proto(data: bytes):
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as e:  # the generated module imports google.protobuf
        raise ImportError("reading a sentencepiece tokenizer.model needs the protobuf package "
                          "(pip install protobuf), or give the model a tokenizer.json") from e
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(data)
    return proto


def merges_from_vocab(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """transformers' generate_merges: every split of a piece into two vocabulary pieces is a merge, ranked by the
    merged piece's id (sentencepiece numbers BPE pieces in merge order), then by the lengths of the two halves.
    Equal keys keep vocabulary order (sorts are stable), as in transformers."""
    merges = []
    for piece, piece_id in vocab.items():
        halves = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        halves.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((left, right, piece_id) for left, right in halves)
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])))
    return [(left, right) for left, right, _ in merges]
