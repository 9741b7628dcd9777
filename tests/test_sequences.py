import numpy as np
import pyarrow as pa
import pytest

from recsys.sequences import Sequences, Vocabulary, pad_left


def test_pad_left_keeps_the_newest_items_right_aligned():
    seqs = Sequences.from_lists([[1, 2, 3], [], [4, 5, 6, 7, 8]])
    assert pad_left(seqs, 4).tolist() == [[0, 1, 2, 3], [0, 0, 0, 0], [5, 6, 7, 8]]


def test_from_arrow_handles_sliced_arrays_and_null_lists():
    arr = pa.array([[9], [1, 2], None, [3, 4, 5]], type=pa.list_(pa.int64())).slice(1)
    seqs = Sequences.from_arrow(arr)
    assert [x.tolist() for x in seqs.to_lists()] == [[1, 2], [], [3, 4, 5]]


def test_take_selects_users_in_the_given_order():
    seqs = Sequences.from_lists([[1], [2, 3], [4, 5, 6]])
    assert [x.tolist() for x in seqs.take(np.array([2, 0])).to_lists()] == [[4, 5, 6], [1]]


def test_offsets_must_match_items():
    with pytest.raises(ValueError, match="offsets end at"):
        Sequences(np.array([0, 3]), np.array([1, 2]))


def test_vocabulary_maps_ids_to_one_based_indices_and_drops_unknown_items():
    vocab = Vocabulary(np.array([50, 10, 30]))
    assert vocab.index_of(np.array([10, 20, 30, 50, 99])).tolist() == [2, 0, 3, 1, 0]
    mapped, unknown = vocab.map_sequences(Sequences.from_lists([[10, 20, 30], [99], [50]]))
    assert [x.tolist() for x in mapped.to_lists()] == [[2, 3], [], [1]]
    assert unknown == 2


def test_vocabulary_rejects_duplicate_ids():
    with pytest.raises(ValueError, match="unique"):
        Vocabulary(np.array([1, 2, 2]))
