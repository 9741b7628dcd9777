"""A synthetic shop: daily event and catalog partitions with the structure real logs have.

Why not uniform random data: every stage downstream is shaped by the data's structure. Scoring
speed depends on how skewed popularity is and how long histories get, the sequence model only
beats popularity if order carries signal, masking only matters if the catalog changes, and the
quality figures only mean something if recent behaviour differs from old. So the generator
plants each of these, on purpose and deterministically for a seed:

- **popularity**: item weights follow a Zipf law (exponent ``ZIPF_EXPONENT``) over a random
  ranking, so a small head of items gets most events; new items get a short launch boost;
- **categories and titles**: ``CATEGORY_NAMES`` (20), of uneven size. An item's category and
  title (e.g. ``"Walnut Garden Lamp #1234"``) are a function of its id alone, the same for every
  seed and every snapshot;
- **users**: 1-3 taste clusters (categories) each, whose weights drift linearly from one set
  to another over the window; lognormal activity (a few very active users, many light ones),
  and a user is active on a day only with a per-user probability;
- **returns**: real users come back to what they know (re-buys, re-views): a returning user's
  item (a user with items from earlier days) is one of those with probability ``repeat_rate``
  (default ``REPEAT_RATE``). The return is drawn from the user's ``MEMORY_SLOTS`` most used items,
  in proportion to uses halved every ``RECENCY_HALF_LIFE_DAYS`` days and to how much the user
  likes the item's category today; after an item whose related item the user had, usually that
  one (``P_RETURN_FOLLOW``). So each user's most frequent items are a strong baseline, but not
  a perfect one;
- **discovery**: every other item is new to its user (rate 0 gives no repeats at all) and follows
  the user's stream (across days too): it is often the fixed "related item" of the previous one
  (``P_FOLLOW_RELATED``) or from its category (``P_SAME_CATEGORY``), else from a taste cluster:
  a sequence model can learn this, popularity cannot. A draw the user already had is drawn again;
- **funnel**: every item a user looks at gets a ``view``; some go on to ``click``,
  ``add_to_cart`` and ``purchase`` (``FUNNEL_DEPTH_P``), each a later event on the same item, so
  views are many and purchases few and every purchase has its view, click and cart before it;
- **catalog**: most items are listed from the first snapshot on; ``NEW_ITEM_SHARE`` launch on
  later days (they have the highest ids, as in a real shop), ``RETIRE_SHARE`` retire during the
  window and ``PRE_RETIRED_SHARE`` are retired already; a retired item stays listed with
  ``available = false``. Every event is on an item that is available in that day's snapshot:
  the generator never emits events on retired or not yet launched items (stricter than real logs).

Timestamps: each active user has one session a day, placed at a uniform random time of the UTC
day, its events a few seconds to minutes apart, all inside the partition's day, ties between a
user's events impossible. Each day's file is sorted by time.

Memory and speed: the generator keeps O(users + items) state, plus every (user, item) pair seen
(8 bytes each, what keeps discoveries new to their user), and builds one day at a time, then
writes it and lets it go; every step is a numpy operation over all of a day's sessions at once
(the only Python loop over a day runs over positions within a session, a few hundred at most).
Time and memory grow linearly with users and events a day (figures: docs/data-contracts.md).
"""
from __future__ import annotations

import datetime as dt
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys.data._output import prepare_dataset_dirs
from recsys.data.contracts import CATALOG_SCHEMA, EVENTS_SCHEMA, start_of_day_us, write_partition
from recsys.errors import InputDataError

CATEGORY_NAMES: tuple[str, ...] = (
    "books", "garden", "kitchen", "electronics", "toys", "sports", "beauty", "music", "movies",
    "games", "home", "office", "pets", "baby", "automotive", "tools", "outdoor", "fashion",
    "health", "grocery",
)
_CATEGORY_NOUNS: tuple[tuple[str, ...], ...] = (
    ("Novel", "Cookbook", "Atlas", "Journal", "Anthology"),
    ("Planter", "Garden Lamp", "Hose Reel", "Trellis", "Seed Kit"),
    ("Skillet", "Kettle", "Knife Set", "Mixing Bowl", "Teapot"),
    ("Headphones", "Speaker", "Charger", "Webcam", "Keyboard"),
    ("Puzzle", "Robot Kit", "Plush Bear", "Building Set", "Kite"),
    ("Yoga Mat", "Dumbbell", "Tennis Racket", "Water Bottle", "Jump Rope"),
    ("Face Cream", "Hair Brush", "Perfume", "Nail Kit", "Lip Balm"),
    ("Vinyl Record", "Ukulele", "Guitar Strings", "Metronome", "Songbook"),
    ("Blu-ray", "Box Set", "Documentary", "Film Poster", "Director's Cut"),
    ("Board Game", "Card Deck", "Chess Set", "Dice Set", "Game Controller"),
    ("Throw Pillow", "Wall Clock", "Vase", "Candle", "Rug"),
    ("Desk Organizer", "Notebook", "Fountain Pen", "Stapler", "Desk Lamp"),
    ("Dog Bed", "Cat Toy", "Leash", "Pet Bowl", "Bird Feeder"),
    ("Stroller", "Baby Blanket", "Rattle", "Bib Set", "Night Light"),
    ("Car Mat", "Seat Cover", "Tire Gauge", "Dash Cam", "Car Charger"),
    ("Drill", "Hammer", "Screwdriver Set", "Tape Measure", "Workbench"),
    ("Tent", "Sleeping Bag", "Lantern", "Backpack", "Camp Stove"),
    ("Scarf", "Jacket", "Handbag", "Wallet", "Sunglasses"),
    ("Vitamin Pack", "Thermometer", "First Aid Kit", "Heating Pad", "Pill Box"),
    ("Coffee Beans", "Olive Oil", "Tea Sampler", "Spice Rack", "Honey Jar"),
)
_ADJECTIVES: tuple[str, ...] = (
    "Walnut", "Copper", "Linen", "Velvet", "Granite", "Maple", "Cobalt", "Amber", "Ivory", "Slate",
    "Bamboo", "Crimson", "Oak", "Silver", "Indigo", "Cedar", "Coral", "Jade", "Marble", "Olive",
    "Pearl", "Rustic", "Sage", "Teal", "Umber", "Vintage", "Willow", "Golden", "Misty", "Sunny",
    "Arctic", "Harbor",
)
EVENT_TYPES: tuple[str, ...] = ("view", "click", "add_to_cart", "purchase")

# The knobs of the simulated behaviour (see the module docstring for what each one plants).
ZIPF_EXPONENT = 1.0
CATEGORY_SIZE_EXPONENT = 0.6      # category c holds a share proportional to 1 / (c + 1) ** this
NEW_ITEM_SHARE = 0.10
RETIRE_SHARE = 0.06
PRE_RETIRED_SHARE = 0.02
LAUNCH_BOOST = 3.0                # a new item's weight is multiplied by 1 + this, decaying by day
LAUNCH_BOOST_DAYS = 2.0
ACTIVITY_SIGMA = 1.2              # lognormal sigma of users' daily activity
SESSION_EVENTS = 3.0              # a user's activity beyond this raises session length, not frequency
MAX_ACTIVE_P = 0.9
MIN_ACTIVE_P = 0.01
TASTE_CLUSTERS_P = (0.4, 0.4, 0.2)  # probability of 1, 2, 3 taste clusters
TASTE_LOGIT_SD = 1.5              # start and end cluster logits are drawn independently
P_FOLLOW_RELATED = 0.40
P_SAME_CATEGORY = 0.20
P_EXPLORE = 0.05                  # an item from the whole catalog; the rest come from the user's tastes
FUNNEL_DEPTH_P = (0.72, 0.18, 0.06, 0.04)  # deepest stage reached: view, click, add_to_cart, purchase
# Returns. 0.75 makes about 70% of a day's (user, item) pairs of returning users repeats on the
# default sample, as on the Wikipedia edit log (docs/data-contracts.md, "Sample data").
REPEAT_RATE = 0.75                # a returning user's item is one they had on an earlier day
MEMORY_SLOTS = 16                 # items a user can come back to: their most used, recency-weighted
RECENCY_HALF_LIFE_DAYS = 2.0      # a use's weight in the return draw halves every this many days
RETURN_TASTE_FLOOR = 0.02         # weight of a category outside the user's tastes (theirs: their share, 0-1)
P_RETURN_FOLLOW = 0.95            # a return after an item goes to its related item, if the user had that one
DISCOVERY_TRIES = 16              # redraws of the discovery model, at once, before the fallback picks an unknown item
STEP_GAP_S = 60.0                 # mean seconds between items in a session
FUNNEL_GAP_S = 15.0               # mean seconds between funnel stages on one item

_DAY_US = 86_400 * 1_000_000
_EVENTS_PER_STEP = float(np.dot(np.arange(1, len(FUNNEL_DEPTH_P) + 1), FUNNEL_DEPTH_P))
_NEVER = np.iinfo(np.int32).max
_NO_LOGIT = np.float32(-1e9)


@dataclass(frozen=True)
class SampleSummary:
    """What was written, for the CLI's one line and for tests; per-day tuples align with the dates."""

    users: int
    items: int
    days: int
    events: int
    active_users: int
    first_date: dt.date
    last_date: dt.date
    events_dir: Path
    catalog_dir: Path
    events_per_day: tuple[int, ...]
    available_items_per_day: tuple[int, ...]
    listed_items_per_day: tuple[int, ...]
    seconds: float

    def __str__(self) -> str:
        return (
            f"sample data: {self.events:,} events from {self.active_users:,} of {self.users:,} users "
            f"on {self.days} days {self.first_date}..{self.last_date}, "
            f"{min(self.available_items_per_day):,}-{max(self.available_items_per_day):,} of "
            f"{self.items:,} items available, in {self.seconds:.1f} s -> {self.events_dir}, {self.catalog_dir}"
        )


@dataclass(frozen=True)
class SampleSpec:
    """What sample to write: ``days`` daily partitions ending at ``end_date`` (default: yesterday, UTC),
    user ids ``1..users``, item ids ``1..items``; ``events_per_user_day`` is the mean over all users,
    active or not. ``repeat_rate`` is the probability that an item a returning user looks at is one
    they had on an earlier day (slightly less in the data, when a user has nothing else to come back
    to): 0 gives no repeats at all, every item new to its user. ``None`` plants no returns and lets
    discoveries fall on items the user had (repeats by chance only): the generator before returns
    were planted, whose data the figures measured before then used (the same seed, the same data).
    The same spec gives the same file contents. Refuses impossible values, naming them."""

    users: int
    items: int
    days: int
    seed: int
    end_date: dt.date | None = None
    events_per_user_day: float = 1.5
    repeat_rate: float | None = REPEAT_RATE

    def __post_init__(self) -> None:
        _check_args(users=self.users, items=self.items, days=self.days, seed=self.seed,
                    events_per_user_day=self.events_per_user_day, repeat_rate=self.repeat_rate)


def generate_sample(out: Path, spec: SampleSpec, *, progress: Callable[[str], None] | None = None,
                    overwrite: bool = False) -> SampleSummary:
    """Write the sample ``spec`` describes under ``out``: ``out/events/dt=.../`` and ``out/catalog/dt=.../``
    (one catalog snapshot a day). ``out`` must not hold date partitions already unless ``overwrite``
    (which replaces them all, see ``_output``).
    """
    users, items, days, seed, events_per_user_day = (spec.users, spec.items, spec.days, spec.seed,
                                                     spec.events_per_user_day)
    end_date, repeat_rate = spec.end_date, spec.repeat_rate
    if end_date is None:
        end_date = dt.datetime.now(dt.timezone.utc).date() - dt.timedelta(days=1)
    first_date = end_date - dt.timedelta(days=days - 1)
    events_dir, catalog_dir = prepare_dataset_dirs(Path(out), overwrite=overwrite)
    started = time.perf_counter()

    world_seed, *day_seeds = np.random.SeedSequence(seed).spawn(days + 1)
    world = _build_world(np.random.default_rng(world_seed), users, items, days, events_per_user_day)
    memory = _Memory.empty(users, items, repeat_rate)
    events_per_day, available, listed = [], [], []
    ever_active = np.zeros(users, dtype=bool)
    for d, day_seed in enumerate(day_seeds):
        date = first_date + dt.timedelta(days=d)
        catalog = _catalog_table(world, d)
        write_partition(catalog, catalog_dir, date)
        events, day_users = _events_table(world, memory, d, days, np.random.default_rng(day_seed), date)
        write_partition(events, events_dir, date)
        ever_active[day_users] = True
        events_per_day.append(events.num_rows)
        available.append(int(pc.sum(catalog["available"]).as_py() or 0))
        listed.append(catalog.num_rows)
        if progress:
            progress(f"{date}: {events.num_rows:,} events from {len(day_users):,} users, "
                     f"{available[-1]:,} of {listed[-1]:,} listed items available")
    return SampleSummary(
        users=users, items=items, days=days, events=sum(events_per_day),
        active_users=int(ever_active.sum()), first_date=first_date, last_date=end_date,
        events_dir=events_dir, catalog_dir=catalog_dir, events_per_day=tuple(events_per_day),
        available_items_per_day=tuple(available), listed_items_per_day=tuple(listed),
        seconds=time.perf_counter() - started,
    )


def _check_args(*, users: int, items: int, days: int, seed: int, events_per_user_day: float,
                repeat_rate: float | None) -> None:
    for name, value in (("users", users), ("items", items), ("days", days)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise InputDataError(f"{name} must be a whole number >= 1, got {value!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InputDataError(f"seed must be a whole number >= 0, got {seed!r}")
    if not (isinstance(events_per_user_day, (int, float)) and math.isfinite(events_per_user_day)
            and events_per_user_day > 0):
        raise InputDataError(f"events_per_user_day must be a number > 0, got {events_per_user_day!r}")
    if repeat_rate is not None and (isinstance(repeat_rate, bool) or not isinstance(repeat_rate, (int, float))
                                    or not 0.0 <= repeat_rate <= 1.0):
        raise InputDataError(f"repeat_rate must be a share from 0 to 1 (default {REPEAT_RATE}), got {repeat_rate!r}")


# --------------------------------------------------------------------------- static world


@dataclass(frozen=True)
class _World:
    """Everything that persists across days: O(users + items). Item index i is item id i + 1."""

    item_cat: np.ndarray       # [I] int16
    base_weight: np.ndarray    # [I] float64, Zipf
    launch_day: np.ndarray     # [I] int32, < 0: listed before the window
    retire_day: np.ndarray     # [I] int32, first day unavailable; _NEVER if it never retires
    related: np.ndarray        # [I] int32, the item that tends to follow this one
    cat_order: np.ndarray      # [I] int64, item indices sorted by category
    cat_bounds: np.ndarray     # [C + 1] int64, category c is cat_order[cat_bounds[c]:cat_bounds[c + 1]]
    titles: pa.Array           # [I] string
    categories: pa.Array       # [I] string
    taste_cat: np.ndarray      # [U, 3] int16
    logit_start: np.ndarray    # [U, 3] float32, _NO_LOGIT for unused slots
    logit_end: np.ndarray      # [U, 3] float32
    p_active: np.ndarray       # [U] float32
    mean_steps: np.ndarray     # [U] float32, items looked at per active day
    last_item: np.ndarray      # [U] int32, the user's latest item index, -1 before any; updated daily


def _mix(ids: np.ndarray, salt: int) -> np.ndarray:
    """A fixed 64-bit hash (splitmix64) of ids: what makes titles and categories seed-independent."""
    z = ids.astype(np.uint64) + np.uint64((salt * 0x9E3779B97F4A7C15) % (1 << 64))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def item_categories(item_ids: np.ndarray) -> np.ndarray:
    """Category index (into ``CATEGORY_NAMES``) of each item id: a pure function of the id."""
    share = 1.0 / np.arange(1, len(CATEGORY_NAMES) + 1) ** CATEGORY_SIZE_EXPONENT
    cum = np.cumsum(share / share.sum())
    u = (_mix(item_ids, 1) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return np.minimum(np.searchsorted(cum, u, side="right"), len(CATEGORY_NAMES) - 1).astype(np.int16)


def item_titles(item_ids: np.ndarray, cats: np.ndarray) -> pa.Array:
    """Readable titles, ``"<Adjective> <category noun> #<id>"``, vectorised with Arrow kernels."""
    adjectives = pa.array(_ADJECTIVES)
    nouns = pa.array([noun for group in _CATEGORY_NOUNS for noun in group])
    per_cat = len(_CATEGORY_NOUNS[0])
    adj = (_mix(item_ids, 2) % np.uint64(len(_ADJECTIVES))).astype(np.int64)
    noun = cats.astype(np.int64) * per_cat + (_mix(item_ids, 3) % np.uint64(per_cat)).astype(np.int64)
    number = pc.binary_join_element_wise("#", pc.cast(pa.array(item_ids), pa.string()), "")
    return pc.binary_join_element_wise(pc.take(adjectives, adj), pc.take(nouns, noun), number, " ")


def _build_world(rng: np.random.Generator, users: int, items: int, days: int,
                 events_per_user_day: float) -> _World:
    item_ids = np.arange(1, items + 1, dtype=np.int64)
    cats = item_categories(item_ids)
    n_cats = len(CATEGORY_NAMES)

    n_new = int(round(items * NEW_ITEM_SHARE)) if days > 1 else 0
    n_old = items - n_new
    launch = np.full(items, -1, dtype=np.int32)
    launch[n_old:] = np.sort(rng.integers(1, max(days, 2), size=n_new))   # newest items, highest ids
    retire = np.full(items, _NEVER, dtype=np.int32)
    n_retire = int(round(n_old * RETIRE_SHARE)) if days > 1 else 0
    n_pre = int(round(n_old * PRE_RETIRED_SHARE))
    chosen = rng.choice(n_old, size=min(n_old, n_retire + n_pre), replace=False)
    retire[chosen[:n_pre]] = 0
    retire[chosen[n_pre:]] = rng.integers(1, max(days, 2), size=len(chosen) - n_pre)

    base_weight = 1.0 / (rng.permutation(items) + 1.0) ** ZIPF_EXPONENT
    cat_order = np.argsort(cats, kind="stable").astype(np.int64)
    cat_bounds = np.searchsorted(cats[cat_order], np.arange(n_cats + 1)).astype(np.int64)
    related = _related_items(rng, base_weight, cats, cat_order, cat_bounds)

    activity = rng.lognormal(0.0, ACTIVITY_SIGMA, size=users)
    rate = events_per_user_day * activity / activity.mean()               # mean events per day
    p_active = np.clip(rate / SESSION_EVENTS, MIN_ACTIVE_P, MAX_ACTIVE_P)
    mean_steps = np.maximum(rate / (p_active * _EVENTS_PER_STEP), 1.0)

    cat_mass = np.bincount(cats, weights=base_weight, minlength=n_cats)
    taste_cat = _taste_categories(rng, users, np.sqrt(cat_mass + 1e-12))
    n_tastes = rng.choice(np.arange(1, 4), size=users, p=TASTE_CLUSTERS_P)
    unused = np.arange(3)[None, :] >= n_tastes[:, None]
    logit_start = rng.normal(0.0, TASTE_LOGIT_SD, size=(users, 3)).astype(np.float32)
    logit_end = rng.normal(0.0, TASTE_LOGIT_SD, size=(users, 3)).astype(np.float32)
    logit_start[unused] = _NO_LOGIT
    logit_end[unused] = _NO_LOGIT

    return _World(
        item_cat=cats, base_weight=base_weight, launch_day=launch, retire_day=retire,
        related=related, cat_order=cat_order, cat_bounds=cat_bounds,
        titles=item_titles(item_ids, cats),
        categories=pc.take(pa.array(CATEGORY_NAMES), pa.array(cats.astype(np.int64))),
        taste_cat=taste_cat, logit_start=logit_start, logit_end=logit_end,
        p_active=p_active.astype(np.float32), mean_steps=mean_steps.astype(np.float32),
        last_item=np.full(users, -1, dtype=np.int32),
    )


def _related_items(rng: np.random.Generator, weight: np.ndarray, cats: np.ndarray,
                   cat_order: np.ndarray, cat_bounds: np.ndarray) -> np.ndarray:
    """Each item's fixed successor: a same-category item, biased (mildly) to popular ones."""
    sampler = _Sampler(np.sqrt(weight), cat_order, cat_bounds)
    related = sampler.in_category(cats.astype(np.int64), rng.random(len(cats)), rng)
    # An item that drew itself takes its neighbour in the category instead (itself if alone).
    pos = np.empty(len(cats), dtype=np.int64)
    pos[cat_order] = np.arange(len(cats))
    c = cats.astype(np.int64)
    nxt = pos + 1
    nxt = np.where(nxt >= cat_bounds[c + 1], cat_bounds[c], nxt)
    self_ = related == np.arange(len(cats))
    related[self_] = cat_order[nxt[self_]]
    return related.astype(np.int32)


def _taste_categories(rng: np.random.Generator, users: int, pref: np.ndarray) -> np.ndarray:
    """Three distinct categories per user, drawn without replacement in proportion to ``pref``."""
    out = np.empty((users, 3), dtype=np.int16)
    log_pref = np.log(pref / pref.sum()).astype(np.float32)
    chunk = 1 << 17                                  # bounds the [chunk, C] Gumbel matrix
    for start in range(0, users, chunk):
        n = min(chunk, users - start)
        keys = log_pref[None, :] + rng.gumbel(size=(n, len(pref))).astype(np.float32)
        top = np.argpartition(-keys, 2, axis=1)[:, :3]
        order = np.argsort(-np.take_along_axis(keys, top, axis=1), axis=1)
        out[start:start + n] = np.take_along_axis(top, order, axis=1)
    return out


# --------------------------------------------------------------------------- one day


class _Sampler:
    """Weighted draws of item indices, overall or within given categories, by inverse CDF.

    Items are laid out by category, so one cumulative sum serves every category: a draw in
    category c is a search for ``before[c] + u * total[c]``. Zero-weight (unavailable) items
    can never be drawn: the search lands on the first position whose cumulative sum exceeds
    the target, which always has positive weight.
    """

    def __init__(self, weight: np.ndarray, cat_order: np.ndarray, cat_bounds: np.ndarray):
        self.cat_order = cat_order
        w = weight[cat_order]
        self.cum = np.cumsum(w)
        edges = np.concatenate([[0.0], self.cum])[cat_bounds]               # [C + 1]
        self.before = edges[:-1]
        self.total = np.diff(edges)
        positive = np.flatnonzero(w > 0)
        # Clamp targets that rounding pushed past a category's last drawable position.
        last = np.searchsorted(positive, cat_bounds[1:], side="left") - 1
        self.last_in_cat = np.where(last >= 0, positive[np.maximum(last, 0)], 0)
        self.last_any = positive[-1] if len(positive) else -1

    @property
    def empty(self) -> bool:
        return self.last_any < 0

    def overall(self, u: np.ndarray) -> np.ndarray:
        pos = np.searchsorted(self.cum, u * self.cum[-1], side="right")
        return self.cat_order[np.minimum(pos, self.last_any)]

    def in_category(self, cats: np.ndarray, u: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """``cats`` [n] category indices -> [n] item indices; empty categories draw overall."""
        total = self.total[cats]
        pos = np.searchsorted(self.cum, self.before[cats] + u * total, side="right")
        items = self.cat_order[np.minimum(pos, self.last_in_cat[cats])]
        empty = total <= 0
        if empty.any():
            items[empty] = self.overall(rng.random(int(empty.sum())))
        return items


def _catalog_table(world: _World, d: int) -> pa.Table:
    listed = world.launch_day <= d
    available = listed & (d < world.retire_day)
    mask = pa.array(listed)
    return pa.table(
        {
            "item_id": pa.array(np.flatnonzero(listed) + 1, type=pa.int64()),
            "available": pa.array(available[listed]),
            "title": world.titles.filter(mask),
            "category": world.categories.filter(mask),
        },
        schema=CATALOG_SCHEMA,
    )


def _day_weights(world: _World, d: int) -> np.ndarray:
    available = (world.launch_day <= d) & (d < world.retire_day)
    age = d - world.launch_day.astype(np.float64)
    boost = np.where(world.launch_day >= 1, 1.0 + LAUNCH_BOOST * np.exp(-np.maximum(age, 0) / LAUNCH_BOOST_DAYS), 1.0)
    return world.base_weight * boost * available


def _events_table(world: _World, memory: _Memory, d: int, days: int, rng: np.random.Generator,
                  date: dt.date) -> tuple[pa.Table, np.ndarray]:
    """One day's events (sorted by time) and the users active that day."""
    weight = _day_weights(world, d)
    sampler = _Sampler(weight, world.cat_order, world.cat_bounds)
    n_users = len(world.p_active)
    memory.new_day()
    active = np.flatnonzero(rng.random(n_users) < world.p_active)
    if sampler.empty or len(active) == 0:
        return EVENTS_SCHEMA.empty_table(), np.zeros(0, dtype=np.int64)

    steps = 1 + rng.poisson(world.mean_steps[active] - 1.0)
    order = np.argsort(-steps, kind="stable")           # longest sessions first: step k uses a prefix
    users, lens = active[order], steps[order]
    offsets = np.zeros(len(users) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    t = d / (days - 1) if days > 1 else 1.0
    sessions = _Sessions(users, lens, offsets)
    items = _session_items(world, memory, _Day(sampler, weight, t), sessions, rng)
    world.last_item[users] = items[offsets[1:] - 1]
    if memory.kept:
        memory.remember(np.repeat(users, lens), items)

    # Funnel: step s emits depth[s] + 1 events on its item, one per stage reached.
    depth = np.searchsorted(np.cumsum(FUNNEL_DEPTH_P), rng.random(len(items)), side="right")
    depth = np.minimum(depth, len(FUNNEL_DEPTH_P) - 1)
    per_step = depth + 1
    ev_step = np.repeat(np.arange(len(items)), per_step)
    step_first = np.cumsum(per_step) - per_step
    ev_type = (np.arange(len(ev_step)) - np.repeat(step_first, per_step)).astype(np.int32)
    ev_session = np.repeat(np.repeat(np.arange(len(users)), lens), per_step)

    ts = _timestamps(rng, ev_type, ev_session, len(users), date)
    by_time = np.argsort(ts, kind="stable")
    table = pa.table(
        {
            "user_id": pa.array(users[ev_session[by_time]] + 1, type=pa.int64()),
            "item_id": pa.array(items[ev_step[by_time]].astype(np.int64) + 1, type=pa.int64()),
            "event_type": pc.take(pa.array(EVENT_TYPES), pa.array(ev_type[by_time])),
            "ts": pa.array(ts[by_time], type=pa.timestamp("us", tz="UTC")),
        },
        schema=EVENTS_SCHEMA,
    )
    return table, users


@dataclass(frozen=True)
class _Sessions:
    """One day's sessions, longest first: whose (``users``), how many steps (``lens``), where each starts
    in the flat step order (``offsets``, one more than sessions)."""

    users: np.ndarray
    lens: np.ndarray
    offsets: np.ndarray


@dataclass
class _Memory:
    """What each user has had, for returns and for discoveries: O(users x slots + user-item pairs).

    ``items``/``score`` hold, per user, the ``MEMORY_SLOTS`` items a return draws from, each with
    its recency-weighted use count (+1 a use, halved every ``RECENCY_HALF_LIFE_DAYS``); a new item
    takes the slot with the lowest score (``use``, at the end of each day, so that a return is to an
    item of an earlier day). ``known`` holds every (user, item) pair of earlier days
    as sorted keys ``user * n_items + item``, so a discovery can be kept new to its user exactly,
    not only new to the slots.
    """

    items: np.ndarray          # [U, K] int32 item index, -1: empty slot
    score: np.ndarray          # [U, K] float32
    known: np.ndarray          # [pairs] int64, sorted
    n_items: int
    repeat_rate: float | None  # None: no returns, no memory kept (repeats by chance only)

    @classmethod
    def empty(cls, users: int, items: int, repeat_rate: float | None) -> "_Memory":
        if repeat_rate is None:
            return cls(items=np.zeros((0, 0), dtype=np.int32), score=np.zeros((0, 0), dtype=np.float32),
                       known=np.zeros(0, dtype=np.int64), n_items=items, repeat_rate=None)
        return cls(items=np.full((users, MEMORY_SLOTS), -1, dtype=np.int32),
                   score=np.zeros((users, MEMORY_SLOTS), dtype=np.float32),
                   known=np.zeros(0, dtype=np.int64), n_items=items, repeat_rate=float(repeat_rate))

    @property
    def kept(self) -> bool:
        return self.repeat_rate is not None

    def new_day(self) -> None:
        self.score *= np.float32(0.5 ** (1.0 / RECENCY_HALF_LIFE_DAYS))

    def knew(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Whether each user had each item on an earlier day."""
        keys = users.astype(np.int64) * self.n_items + items
        pos = np.minimum(np.searchsorted(self.known, keys), max(len(self.known) - 1, 0))
        return (self.known[pos] == keys) if len(self.known) else np.zeros(len(keys), dtype=bool)

    def remember(self, users: np.ndarray, items: np.ndarray) -> None:
        """At the end of a day: its (user, item) pairs join ``known`` (a merge of two sorted runs)."""
        keys = np.sort(users.astype(np.int64) * self.n_items + items)
        keys = keys[np.concatenate(([True], keys[1:] != keys[:-1]))]
        keys = keys[~self.knew(keys // self.n_items, keys % self.n_items)]
        merged = np.concatenate((self.known, keys))
        merged.sort(kind="stable")
        self.known = merged

    def returns(self, users: np.ndarray, prev: np.ndarray, affinity: np.ndarray, item_cat: np.ndarray,
                available: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One returning item per user, drawn in proportion to the slots' scores times the user's
        ``affinity`` [n, categories] to the item's category today (tastes drift, and so do returns),
        among available items other than the user's previous one (``prev``: coming back is to
        something else than what is on screen); -1 for a user with nothing to come back to."""
        slots = self.items[users]                                                   # [n, K]
        usable = (slots >= 0) & (slots != prev[:, None]) & available[np.maximum(slots, 0)]
        liking = np.take_along_axis(affinity, item_cat[np.maximum(slots, 0)].astype(np.int64), axis=1)
        weight = self.score[users] * liking * usable
        cum = np.cumsum(weight, axis=1)
        total = cum[:, -1]
        slot = (cum <= (rng.random(len(users)) * total)[:, None]).sum(axis=1)
        picked = slots[np.arange(len(users)), np.minimum(slot, MEMORY_SLOTS - 1)].astype(np.int64)
        return np.where(total > 0, picked, -1)

    def unknown_items(self, users: np.ndarray, taste_cats: np.ndarray, today: np.ndarray, fallback: np.ndarray,
                      item_cat: np.ndarray, day: "_Day", rng: np.random.Generator) -> np.ndarray:
        """For each user (row), an available item they never had, by popularity, from their taste categories
        (``taste_cats``) if one is left there; ``fallback`` (a repeat) only for a user who has had every
        available item. ``today`` [n, k]: the items of each user's session so far. Row by item masks, in chunks."""
        n_items = len(day.weight)
        out = fallback.copy()
        chunk = max(1, (1 << 22) // n_items)
        for start in range(0, len(users), chunk):
            rows = slice(start, start + chunk)
            u = users[rows].astype(np.int64)
            new = np.repeat(day.available[None, :], len(u), axis=0)                     # [r, I]
            lo = np.searchsorted(self.known, u * n_items)
            hi = np.searchsorted(self.known, (u + 1) * n_items)
            counts = hi - lo
            which = np.repeat(np.arange(len(u)), counts)
            pos = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts) + np.repeat(lo, counts)
            new[which, self.known[pos] - u[which] * n_items] = False
            new[np.repeat(np.arange(len(u)), today.shape[1]), today[rows].ravel()] = False
            liked = np.zeros((len(u), len(CATEGORY_NAMES)), dtype=bool)
            liked[np.arange(len(u))[:, None], taste_cats[rows]] = True
            in_taste = new & liked[:, item_cat]
            pool = np.where(in_taste.any(axis=1)[:, None], in_taste, new)
            cum = np.cumsum(np.where(pool, day.weight[None, :], 0.0), axis=1)
            total = cum[:, -1]
            pick = np.minimum((cum <= (rng.random(len(u)) * total)[:, None]).sum(axis=1), n_items - 1)
            out[rows] = np.where(total > 0, pick, fallback[rows])
        return out

    def use(self, users: np.ndarray, items: np.ndarray) -> None:
        """Count one use of each item by its user (users distinct): +1 in its slot, or the weakest slot."""
        hit = self.items[users] == items[:, None]                                   # [n, K]
        held = hit.any(axis=1)
        self.score[users[held], hit[held].argmax(axis=1)] += 1.0
        fresh = users[~held]
        weakest = np.argmin(self.score[fresh], axis=1)                              # an empty slot scores 0
        self.items[fresh, weakest] = items[~held]
        self.score[fresh, weakest] = 1.0


@dataclass(frozen=True)
class _Day:
    """What one day's draws share: the sampler over its available items, their weights, the taste drift ``t``
    (0 on the first day, 1 on the last)."""

    sampler: _Sampler
    weight: np.ndarray
    t: float

    @property
    def available(self) -> np.ndarray:
        return self.weight > 0


def _session_items(world: _World, memory: _Memory, day: _Day, sessions: _Sessions,
                   rng: np.random.Generator) -> np.ndarray:
    """The item index of every step of every session, flat in session order.

    A returning user (one with items from earlier days) comes back to one of those
    (``memory.returns``) with probability ``memory.repeat_rate``; every other step is a discovery
    (``_discover``), redrawn until it is an item new to the user, today included. Sessions are
    sorted longest first, so the sessions still running at position k are a prefix and each
    position is one vectorised draw over them. Today's items join the memory when the day is over.
    """
    users, lens, offsets = sessions.users, sessions.lens, sessions.offsets
    logits = (1.0 - day.t) * world.logit_start[users] + day.t * world.logit_end[users]   # [n, 3]
    prob = np.exp(logits - logits.max(axis=1, keepdims=True))
    prob /= prob.sum(axis=1, keepdims=True)
    taste_cat = world.taste_cat[users].astype(np.int64)                              # [n, 3]
    affinity = np.full((len(users), len(CATEGORY_NAMES)), RETURN_TASTE_FLOOR, dtype=np.float32)
    np.add.at(affinity, (np.arange(len(users))[:, None], taste_cat), prob.astype(np.float32))
    taste = _Tastes(np.cumsum(prob, axis=1), taste_cat, affinity)
    running = np.searchsorted(-lens, -np.arange(int(lens[0])), side="left")          # sessions with len > k
    available = day.available

    out = np.empty(int(offsets[-1]), dtype=np.int64)
    for k, m in enumerate(running):
        at = offsets[:m] + k
        who = users[:m]
        prev = world.last_item[who].astype(np.int64) if k == 0 else out[at - 1]
        draw = np.full(m, -1, dtype=np.int64)
        if memory.kept and memory.repeat_rate > 0:
            back = np.flatnonzero(rng.random(m) < memory.repeat_rate)
            draw[back] = memory.returns(who[back], prev[back], taste.affinity[back], world.item_cat,
                                        available, rng)               # -1: nothing to come back to
            # Returns keep the order too: to the previous item's related one, when the user had it.
            rel = world.related[np.maximum(prev[back], 0)].astype(np.int64)
            follow = (prev[back] >= 0) & (rng.random(len(back)) < P_RETURN_FOLLOW) & available[rel]
            follow[follow] = memory.knew(who[back[follow]], rel[follow])
            draw[back[follow]] = rel[follow]
        new = np.flatnonzero(draw < 0)
        draw[new] = _discover(world, day, taste, new, prev[new], rng)
        if not memory.kept:
            out[at] = draw
            continue
        new = new[_had(memory, out, offsets, who, new, draw[new], k)]
        if len(new):                  # redraws, all at once: the first one new to the user wins
            again = np.repeat(new, DISCOVERY_TRIES)
            tries = _discover(world, day, taste, again, prev[again], rng)
            fresh = ~_had(memory, out, offsets, who, again, tries, k).reshape(len(new), DISCOVERY_TRIES)
            found = fresh.any(axis=1)
            draw[new[found]] = tries.reshape(len(new), DISCOVERY_TRIES)[found, fresh[found].argmax(axis=1)]
            new = new[~found]
        if len(new):                  # the model keeps drawing items the user had: pick among the others
            draw[new] = memory.unknown_items(who[new], taste.cats[new], out[offsets[new][:, None] + np.arange(k)],
                                             draw[new], world.item_cat, day, rng)
        out[at] = draw
    for k, m in enumerate(running if memory.kept else ()):   # today's items join the memory after the day
        memory.use(users[:m], out[offsets[:m] + k])
    return out


@dataclass(frozen=True)
class _Tastes:
    """The day's sessions' taste clusters: cumulative weight and category of each of 3 slots, [n, 3]; and
    how much each user likes each category today, [n, categories] (a floor for the others)."""

    cum: np.ndarray
    cats: np.ndarray
    affinity: np.ndarray


def _discover(world: _World, day: _Day, taste: _Tastes, rows: np.ndarray, prev: np.ndarray,
              rng: np.random.Generator) -> np.ndarray:
    """The discovery model, for the sessions ``rows`` whose previous items are ``prev`` (-1: none):
    the previous item's related item or category, else a taste category, sometimes the whole catalog."""
    m = len(rows)
    has_prev = prev >= 0
    r = rng.random(m)
    follow = has_prev & (r < P_FOLLOW_RELATED)
    same = has_prev & ~follow & (r < P_FOLLOW_RELATED + P_SAME_CATEGORY)
    explore = r >= 1.0 - P_EXPLORE

    slot = (rng.random(m)[:, None] > taste.cum[rows]).sum(axis=1)
    cats = taste.cats[rows, np.minimum(slot, 2)]
    prev_cat = world.item_cat[np.maximum(prev, 0)].astype(np.int64)
    cats = np.where(follow | same, prev_cat, cats)      # an unavailable related item falls back here
    draw = day.sampler.in_category(cats, rng.random(m), rng)
    if explore.any():
        draw[explore] = day.sampler.overall(rng.random(int(explore.sum())))
    rel = world.related[np.maximum(prev, 0)].astype(np.int64)
    use_rel = follow & day.available[rel]
    draw[use_rel] = rel[use_rel]
    return draw


def _had(memory: _Memory, out: np.ndarray, offsets: np.ndarray, users: np.ndarray, rows: np.ndarray,
         items: np.ndarray, k: int) -> np.ndarray:
    """Whether the sessions ``rows`` had ``items`` before: on an earlier day, or earlier in the session."""
    had = memory.knew(users[rows], items)
    if k:
        earlier = out[offsets[rows][:, None] + np.arange(k)]                      # [n, k]
        had |= (earlier == items[:, None]).any(axis=1)
    return had


def _timestamps(rng: np.random.Generator, ev_type: np.ndarray, ev_session: np.ndarray,
                n_sessions: int, date: dt.date) -> np.ndarray:
    """Microseconds since the epoch: each session at a random time of ``date`` (UTC), inside the day."""
    mean_gap = np.where(ev_type == 0, STEP_GAP_S, FUNNEL_GAP_S)
    gap = ((1.0 + rng.exponential(mean_gap)) * 1e6).astype(np.int64)     # >= 1 s: no ties in a session
    first = np.searchsorted(ev_session, np.arange(n_sessions))          # ev_session is sorted
    gap[first] = 0
    cum = np.cumsum(gap)
    offset = cum - cum[first][ev_session]                               # since the session's first event
    duration = offset[np.append(first[1:], len(ev_session)) - 1]
    too_long = duration >= _DAY_US
    if too_long.any():                                                  # squeeze a session into the day
        scale = np.where(too_long, (_DAY_US - 1) / (duration + 1.0), 1.0)
        offset = (offset * scale[ev_session]).astype(np.int64)
        duration = np.minimum(duration, _DAY_US - 1)
    start = (rng.random(n_sessions) * (_DAY_US - duration)).astype(np.int64)
    return start_of_day_us(date) + start[ev_session] + offset
