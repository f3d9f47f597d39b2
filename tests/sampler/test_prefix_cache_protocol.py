"""The prefix cache reads how a family takes it from the family's record, not from its identity."""
import re
from pathlib import Path

from daca_kernels.models import families
from daca_kernels.rollout import prefix_cache

RECORDS = [value for value in vars(families).values() if isinstance(value, families.Family)]


def test_every_full_attention_family_names_a_driver_and_block_families_none():
    assert {f.name for f in RECORDS} == {"llada", "llada_moe", "dream", "sdar", "llada2", "generic"}
    for family in RECORDS:
        if family.block:
            assert family.prefix_cache is None, family.name
        else:
            assert family.prefix_cache.driver in prefix_cache.DRIVERS, family.name


def test_the_cache_code_tests_no_family_identity():
    source = Path(prefix_cache.__file__).read_text()
    names = [name for name, value in vars(families).items() if isinstance(value, families.Family)]
    found = re.findall(r"families\.(" + "|".join(names) + r")\b", source)
    assert not found, f"prefix_cache.py tests family identity: {found}"
