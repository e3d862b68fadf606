"""numpy's Mersenne Twister jumped ahead by any count of words: the state drawing that many would leave.

numpy only moves an MT19937 on by drawing (`random_raw`: 1.6-3.6 ns a word, 13-19 ms for one `Rand3DElasticd`
item's 5.3 M words) or by the fixed 2^128 of `jumped()`. The generator is linear over GF(2): its untempered
words obey one recurrence whose characteristic polynomial P has degree 19,937, so for any n, with
q(x) = x^n mod P, the word n places on from any word is the XOR of the words i places on for each i where q has
a one. A state 624 words long is then the XOR of about 10,000 windows of the next 20,560 words: 2-3 ms whatever
n is. P is found once per process by Berlekamp-Massey from the generator's own output (its degree checked), and
x^n mod P once per count by squaring; each jump leaves the state in numpy's own form (the same key and position
drawing would leave), so it compares equal with `get_state`.

numpy and the standard library only: the stream helper process runs this file without importing the package.
"""

from __future__ import annotations

import functools
import os

import numpy as np

N = 624  # words of state
DEGREE = 19937  # the recurrence's order: N * 32 - 31
_SPAN = DEGREE - 1 + N  # words from the second word of the key on that a jump's windows cover
_CHUNK = 128  # windows XORed at once (a 128 x 624 block stays in cache)
JUMP_FROM = 1 << 20  # words an item from which jumping (2-3 ms) beats drawing (1.6-3.6 ns a word)


def _untemper(y: np.ndarray) -> np.ndarray:
    """The generator's words before tempering (the inverse of MT19937's output map), elementwise."""
    y = y.astype(np.uint32)
    y = y ^ (y >> np.uint32(18))
    y = y ^ ((y << np.uint32(15)) & np.uint32(0xEFC60000))
    t = y
    for _ in range(4):
        t = y ^ ((t << np.uint32(7)) & np.uint32(0x9D2C5680))
    y = t
    t = y
    for _ in range(2):
        t = y ^ (t >> np.uint32(11))
    return t


def _words_after(key: np.ndarray, count: int) -> np.ndarray:
    """The `count` untempered words that follow the 624 of `key` (drawn by numpy from key at position 624)."""
    g = np.random.MT19937()
    g.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": N}}
    return _untemper(g.random_raw(count).astype(np.uint32))


@functools.lru_cache(maxsize=1)
def charpoly() -> int:
    """P as an int (bit i: the coefficient of x^i), by Berlekamp-Massey over the low bit of 2 * DEGREE words;
    ValueError where what it finds is not of degree DEGREE."""
    g = np.random.MT19937(5489)
    bits = (g.random_raw(2 * DEGREE + 64) & 1).astype(np.uint8)
    c, b, length, m = 1, 1, 0, 1
    window = 0  # bit i: the sequence's bit n - i
    for n, s in enumerate(bits.tolist()):
        window = (window << 1) | s
        if (c & window).bit_count() & 1 == 0:
            m += 1
        elif 2 * length <= n:
            c, b, length, m = c ^ (b << m), c, n + 1 - length, 1
        else:
            c ^= b << m
            m += 1
    if length != DEGREE:
        raise ValueError(f"MT19937's recurrence found of order {length}, not {DEGREE}")
    # c is the connection polynomial (c_0 = 1); the characteristic polynomial is its reverse
    return int(bin(c)[2:].rjust(length + 1, "0")[::-1], 2)


def _square(a: int) -> int:
    """a(x)^2 over GF(2): each bit moved to twice its place."""
    if a == 0:
        return 0
    raw = np.frombuffer(a.to_bytes((a.bit_length() + 7) // 8, "little"), np.uint8)
    bits = np.unpackbits(raw, bitorder="little")
    spread = np.zeros(2 * bits.size, np.uint8)
    spread[::2] = bits
    return int.from_bytes(np.packbits(spread, bitorder="little").tobytes(), "little")


def _reduce(a: int, p: int) -> int:
    """a mod p over GF(2)."""
    d = p.bit_length()
    while (n := a.bit_length()) >= d:
        a ^= p << (n - d)
    return a


@functools.lru_cache(maxsize=256)
def xpow(n: int) -> int:
    """x^n mod P."""
    p = charpoly()
    r = 1
    for bit in bin(n)[2:]:
        r = _reduce(_square(r), p)
        if bit == "1":
            r <<= 1
            if r >> DEGREE:
                r ^= p
    return r


@functools.lru_cache(maxsize=256)
def _ones(c: int) -> np.ndarray:
    """Where x^(624c - 1) mod P has a one: the windows whose XOR is the key `c` twists on."""
    q = xpow(N * c - 1)  # from the second word of key (the first's low 31 bits are outside the recurrence)
    raw = np.frombuffer(q.to_bytes(DEGREE // 8 + 1, "little"), np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little")[:DEGREE]).astype(np.int32)


def _block(xs: np.ndarray, c: int) -> np.ndarray:
    """The key numpy holds `c` >= 1 twists after a key whose second word on is `xs` (`_SPAN` words)."""
    windows = np.lib.stride_tricks.sliding_window_view(xs, N)
    ones = _ones(c)
    out = np.zeros(N, np.uint32)
    for at in range(0, ones.size, _CHUNK):
        out ^= np.bitwise_xor.reduce(windows[ones[at : at + _CHUNK]], axis=0)
    return out


def _place(t: int) -> tuple[int, int]:
    """(twists, position) where numpy's MT19937 stands `t` words on from a key at position 0: it twists only
    when it next draws, so the end of a block stays at the block's end (position 624)."""
    c, at = divmod(t, N)
    return (c - 1, N) if at == 0 and c > 0 else (c, at)


def starts(key: np.ndarray, pos: int, words: int, items: int) -> list[tuple[np.ndarray, int]]:
    """Each of `items` items' start (key, pos) where each draws `words` words from numpy's MT19937 at (key, pos),
    and the end of the last: items + 1 states, in numpy's own form (the twist made when it next draws)."""
    key = np.asarray(key, dtype=np.uint32)
    xs: np.ndarray | None = None
    out = []
    for k in range(items + 1):
        c, at = _place(pos + k * words)
        if c == 0:
            out.append((key.copy(), at))
            continue
        if xs is None:
            xs = np.concatenate([key[1:], _words_after(key, _SPAN - (N - 1))])
        out.append((_block(xs, c), at))
    return out


def jump(key: np.ndarray, pos: int, words: int) -> tuple[np.ndarray, int]:
    """The (key, pos) numpy's MT19937 at (key, pos) holds after drawing `words` words."""
    return starts(key, pos, words, 1)[1]


def skipped(key: np.ndarray, pos: int, words: int, items: int) -> list[tuple[np.ndarray, int]]:
    """`starts` by drawing: numpy moving a copy of the generator past each item's words in turn."""
    g = np.random.MT19937()
    g.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": pos}}
    out = []
    for k in range(items + 1):
        s = g.state["state"]
        out.append((s["key"], s["pos"]))
        if k < items:
            g.random_raw(words, output=False)
    return out


def prepare(words: int, items: int) -> None:
    """Find P and every x^n mod P a batch of `items` items of `words` words can ask for, from any position."""
    if words < JUMP_FROM:
        return
    for k in range(1, items + 1):
        for pos in range(N + 1):
            c = _place(pos + k * words)[0]
            if c:
                _ones(c)


def moved(key: np.ndarray, pos: int, words: int, items: int) -> list[tuple[np.ndarray, int]]:
    """`starts`, jumped where an item's words are many enough, else drawn."""
    return (starts if words >= JUMP_FROM else skipped)(key, pos, words, items)


def serve() -> None:
    """The stream helper's loop: a request is a 4-byte little-endian length, then the pickled (key, pos, words an
    item, items); the reply the pickled `moved` the same way (a key of None: `prepare`, an empty reply). EOF ends
    it."""
    import pickle
    import struct
    import sys

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while len(head := inp.read(4)) == 4:
        key, pos, words, items = pickle.loads(inp.read(struct.unpack("<I", head)[0]))
        if key is None:  # made ready for such batches: nothing to send back but that it is
            prepare(words, items)
            got = []
        else:
            got = moved(key, pos, words, items)
        body = pickle.dumps(got, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            out.write(struct.pack("<I", len(body)) + body)
            out.flush()
        except BrokenPipeError:  # the process that asked has ended (a forked worker's exit): so does this one
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())  # nothing left to flush at exit
            return


if __name__ == "__main__":
    serve()
