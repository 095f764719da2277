import concurrent.futures

import pytest

from kvjax.lru_table import LruTable


def test_values_are_computed_once_and_the_least_recently_used_goes_first():
  table, computed = LruTable(max_entries=2), []

  def value_of(key):
    def compute():
      computed.append(key)
      return key * 10

    return table.get_or_compute(key, compute)

  assert [value_of(k) for k in (1, 2, 1, 3)] == [10, 20, 10, 30]
  assert computed == [1, 2, 3]  # 1 read back, not recomputed
  assert table.most_recent() == 30
  # 2 was the least recently used when 3 arrived; 1 stayed.
  assert value_of(1) == 10 and value_of(2) == 20
  assert computed == [1, 2, 3, 2]


def test_a_table_that_keeps_nothing_still_returns_what_each_call_computed():
  table = LruTable(max_entries=0)
  with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
    values = list(pool.map(lambda k: table.get_or_compute(k, lambda: k + 1), range(16)))
  assert values == [k + 1 for k in range(16)]


def test_bad_sizes_are_refused_and_an_empty_table_says_so():
  for bad in (-1, 2.5, True, "3"):
    with pytest.raises(ValueError, match=r"max_entries=.* must be an int >= 0"):
      LruTable(max_entries=bad)
  table = LruTable(max_entries=0)
  with pytest.raises(LookupError, match="the table is empty"):
    table.most_recent()
  table.get_or_compute(1, lambda: 2)
  with pytest.raises(LookupError, match="the table is empty"):
    table.most_recent()
