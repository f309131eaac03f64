/* The event scanner of the Kineto reader (scan.py): the elements of a trace's `traceEvents` array
 * straight into columns, one pass over the bytes, no object per event.
 *
 * strag_scan reads whole events from buf[pos:len] (pos: the start of an element, or the
 * whitespace before it) and writes, per event, the columns scan.py turns into `EventColumns`:
 * category code (CATEGORY_CODES in scan.py; 0 for every other category or none), ph
 * (1 X, 2 s, 3 f, 0 other or none), ts and dur (NaN when absent or null), the ids of the tid and
 * name (interned in the state's tables, -1 when absent or not read), args.correlation (INT64_MIN
 * when absent or null), and the byte span of the args object (relative to the call's pos; -1 when
 * absent or null). Names are read of the categories whose names the converter reads (codes 3-8),
 * tids of those and the CUDA calls (1-2). Every value is checked as JSON (strings, escapes,
 * numbers, literals, nesting) while it is skipped.
 *
 * It stops, and says why in result[2], at the array's `]` (END, consumed), when `cap` events are
 * written (FULL), at an event that does not end before `len` (MORE: give more bytes), at malformed
 * JSON (BAD), or at an event the columns do not take (STRAY: not an object, a key with an escape,
 * ph/cat no string, ts/dur no finite number, a tid that is an object or array, args no object, a
 * correlation that is no int64, nesting deeper than 256). result[0] is the events written,
 * result[1] the position to go on from: after the last whole event and its `,` (or `]`). On BAD
 * and STRAY the caller decodes from there the way it did before the scanner (msgspec), which
 * says what is wrong or reads what the columns do not take.
 *
 * Numbers: one whose digits make a mantissa m below 2^53 and whose power of ten k is at most 22
 * is exact as one IEEE operation (m / 10^k, m * 10^k: both operands exact, one rounding); every
 * other number goes through strtod. Both round correctly, as msgspec does. A correlation is an
 * integer of at most 18 digits here (a longer one: STRAY).
 */
#include <math.h>
#include <stdint.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

enum { MORE = 0, END = 1, FULL = 2, BAD = -1, STRAY = -2, NOMEM = -3, OK = 3 };
enum { MAX_DEPTH = 256 };

typedef struct {
    char *arena;
    int64_t arena_len, arena_cap;
    int64_t *offset;
    int32_t *length;
    uint64_t *hash;
    int64_t count, cap;
    int32_t *slots;      /* open addressing: id + 1, 0 empty */
    int64_t n_slots;
} table_t;

typedef struct {
    table_t names, tids;
} state_t;

typedef struct {
    const uint8_t *p, *e;
} cur_t;

static uint8_t string_special[256];   /* '"', '\\' and control characters */
static uint8_t ends_value[256];       /* ',', '}', ']' and whitespace: what may follow a number */
static int8_t hex_value[256];
static int tables_ready;

/* filled once, when the library is loaded (before any thread can scan) */
__attribute__((constructor)) static void init_tables(void) {
    if (tables_ready) return;
    for (int i = 0; i < 256; i++) {
        string_special[i] = (i < 0x20 || i == '"' || i == '\\');
        ends_value[i] = (i == ',' || i == '}' || i == ']' || i == ' ' || i == '\n' || i == '\r' || i == '\t');
        hex_value[i] = (i >= '0' && i <= '9') ? i - '0' : (i >= 'a' && i <= 'f') ? i - 'a' + 10
                     : (i >= 'A' && i <= 'F') ? i - 'A' + 10 : -1;
    }
    tables_ready = 1;
}

void *strag_scan_new(void) {
    init_tables();
    return calloc(1, sizeof(state_t));
}

static void table_free(table_t *t) {
    free(t->arena); free(t->offset); free(t->length); free(t->hash); free(t->slots);
}

void strag_scan_free(void *state) {
    state_t *s = state;
    if (!s) return;
    table_free(&s->names);
    table_free(&s->tids);
    free(s);
}

static uint64_t hash_bytes(const uint8_t *p, int64_t n) {
    uint64_t h = 1469598103934665603ULL;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 1099511628211ULL;
        h ^= h >> 29;
        p += 8; n -= 8;
    }
    while (n-- > 0) h = (h ^ *p++) * 1099511628211ULL;
    h ^= h >> 32;
    return h;
}

static int table_grow_slots(table_t *t) {
    int64_t n = t->n_slots ? t->n_slots * 2 : 1024;
    int32_t *slots = calloc((size_t)n, sizeof(int32_t));
    if (!slots) return 0;
    for (int64_t id = 0; id < t->count; id++) {
        int64_t at = (int64_t)(t->hash[id] & (uint64_t)(n - 1));
        while (slots[at]) at = (at + 1) & (n - 1);
        slots[at] = (int32_t)(id + 1);
    }
    free(t->slots);
    t->slots = slots;
    t->n_slots = n;
    return 1;
}

/* the id of bytes p[0:n] in t, added when new; -1 when out of memory */
static int32_t intern(table_t *t, const uint8_t *p, int64_t n) {
    uint64_t h = hash_bytes(p, n);
    if ((t->count + 1) * 2 > t->n_slots && !table_grow_slots(t)) return -1;
    int64_t mask = t->n_slots - 1, at = (int64_t)(h & (uint64_t)mask);
    for (;;) {
        int32_t slot = t->slots[at];
        if (!slot) break;
        int64_t id = slot - 1;
        if (t->hash[id] == h && t->length[id] == n && memcmp(t->arena + t->offset[id], p, (size_t)n) == 0)
            return (int32_t)id;
        at = (at + 1) & mask;
    }
    if (t->count == t->cap) {
        int64_t cap = t->cap ? t->cap * 2 : 256;
        int64_t *offset = realloc(t->offset, (size_t)cap * sizeof(int64_t));
        if (!offset) return -1;
        t->offset = offset;
        int32_t *length = realloc(t->length, (size_t)cap * sizeof(int32_t));
        if (!length) return -1;
        t->length = length;
        uint64_t *hash = realloc(t->hash, (size_t)cap * sizeof(uint64_t));
        if (!hash) return -1;
        t->hash = hash;
        t->cap = cap;
    }
    if (t->arena_len + n > t->arena_cap) {
        int64_t cap = t->arena_cap ? t->arena_cap : 4096;
        while (cap < t->arena_len + n) cap *= 2;
        char *arena = realloc(t->arena, (size_t)cap);
        if (!arena) return -1;
        t->arena = arena;
        t->arena_cap = cap;
    }
    memcpy(t->arena + t->arena_len, p, (size_t)n);
    int64_t id = t->count++;
    t->offset[id] = t->arena_len;
    t->length[id] = (int32_t)n;
    t->hash[id] = h;
    t->arena_len += n;
    t->slots[at] = (int32_t)(id + 1);
    return (int32_t)id;
}

/* how many entries table `which` (0 names, 1 tids) holds */
int64_t strag_scan_count(void *state, int which) {
    state_t *s = state;
    return which ? s->tids.count : s->names.count;
}

/* entries [first, count) of table `which`: their bytes one after the other into out (of size
 * cap), their lengths into lengths; returns the bytes written, -1 when cap is too small */
int64_t strag_scan_entries(void *state, int which, int64_t first, char *out, int64_t cap, int32_t *lengths) {
    state_t *s = state;
    table_t *t = which ? &s->tids : &s->names;
    int64_t written = 0;
    for (int64_t id = first; id < t->count; id++) {
        int64_t n = t->length[id];
        if (written + n > cap) return -1;
        memcpy(out + written, t->arena + t->offset[id], (size_t)n);
        lengths[id - first] = (int32_t)n;
        written += n;
    }
    return written;
}

/* the bytes table `which` holds in all (for the caller's buffer) */
int64_t strag_scan_bytes(void *state, int which, int64_t first) {
    state_t *s = state;
    table_t *t = which ? &s->tids : &s->names;
    return first < t->count ? t->arena_len - t->offset[first] : 0;
}

/* ------------------------------------------------------------------ JSON pieces */

#define ONES 0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL

/* the first '"', '\\' or control character at or after p (e when none): 8 bytes at a time. Per
 * word, a byte is flagged when it is zero after xor with '"' or '\\', or below 0x20; the lowest
 * flag is exact (borrows only reach the bytes above it), which is all that is read. */
static inline const uint8_t *string_run(const uint8_t *p, const uint8_t *e) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    while (p + 8 <= e) {
        uint64_t word, quote, slash;
        memcpy(&word, p, 8);
        quote = word ^ (ONES * '"');
        slash = word ^ (ONES * '\\');
        uint64_t flags = (((quote - ONES) & ~quote) | ((slash - ONES) & ~slash) | ((word - ONES * 0x20) & ~word)) & HIGHS;
        if (flags) return p + (__builtin_ctzll(flags) >> 3);
        p += 8;
    }
#endif
    while (p < e && !string_special[*p]) p++;
    return p;
}

/* past whitespace: every byte that is not whitespace exceeds ' ' but control characters, which
 * no JSON holds outside strings; torch.profiler indents its events: a newline and its indent are
 * passed 16 bytes at a time */
static inline void skip_ws(cur_t *c) {
    const uint8_t *p = c->p, *e = c->e;
    if (p < e && *p > ' ') return;                                   /* none: the most frequent */
    if (p + 1 < e && *p == ' ' && p[1] > ' ') { c->p = p + 1; return; }   /* the space after `,` or `:` */
#ifdef __SSE2__
    while (p + 16 <= e) {
        __m128i bytes = _mm_loadu_si128((const __m128i *)p);
        __m128i space = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(bytes, _mm_set1_epi8(' ')),
                                                  _mm_cmpeq_epi8(bytes, _mm_set1_epi8('\n'))),
                                     _mm_or_si128(_mm_cmpeq_epi8(bytes, _mm_set1_epi8('\r')),
                                                  _mm_cmpeq_epi8(bytes, _mm_set1_epi8('\t'))));
        unsigned other = ~(unsigned)_mm_movemask_epi8(space) & 0xFFFFu;
        if (other) { c->p = p + __builtin_ctz(other); return; }
        p += 16;
    }
#endif
    while (p < e && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t')) p++;
    c->p = p;
}

/* the string at c->p (a '"'): its content [*s, *se), whether it holds an escape */
static int scan_string(cur_t *c, const uint8_t **s, const uint8_t **se, int *escaped) {
    const uint8_t *p = c->p + 1, *e = c->e;
    int esc = 0;
#ifdef __SSE2__
    const __m128i quote = _mm_set1_epi8('"'), backslash = _mm_set1_epi8('\\'), control = _mm_set1_epi8(0x1f);
#endif
    for (;;) {
#ifdef __SSE2__
        /* 16 bytes at a time to the first '"', '\\' or control character */
        while (p + 16 <= e) {
            __m128i bytes = _mm_loadu_si128((const __m128i *)p);
            __m128i hit = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(bytes, quote), _mm_cmpeq_epi8(bytes, backslash)),
                                       _mm_cmpeq_epi8(_mm_max_epu8(bytes, control), control));
            int mask = _mm_movemask_epi8(hit);
            if (mask) { p += __builtin_ctz((unsigned)mask); break; }
            p += 16;
        }
#endif
        while (p + 4 <= e && !string_special[p[0]] && !string_special[p[1]] && !string_special[p[2]]
               && !string_special[p[3]])
            p += 4;
        if (p >= e) return MORE;
        uint8_t ch = *p;
        if (ch == '"') break;
        if (ch == '\\') {
            esc = 1;
            if (p + 1 >= e) return MORE;
            uint8_t n = p[1];
            if (n == 'u') {
                if (p + 6 > e) return MORE;
                if ((hex_value[p[2]] | hex_value[p[3]] | hex_value[p[4]] | hex_value[p[5]]) < 0) return BAD;
                p += 6;
                continue;
            }
            if (n == '"' || n == '\\' || n == '/' || n == 'b' || n == 'f' || n == 'n' || n == 'r' || n == 't') {
                p += 2;
                continue;
            }
            return BAD;
        }
        if (ch < 0x20) return BAD;
        p++;
    }
    if (s) { *s = c->p + 1; *se = p; *escaped = esc; }
    c->p = p + 1;
    return OK;
}

/* digits are taken into the mantissa while it is below this (18 digits at least; more: strtod) */
#define BIG 100000000000000000ULL
static const double POW10[23] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14,
                                  1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* the number at c->p: checked against JSON's grammar; its value when value is given; *integral
 * when it has no fraction or exponent, then *whole its value when it fits an int64 (*fits) */
/* past a run of digits, 8 at a time where the bytes allow */
static inline const uint8_t *skip_digits(const uint8_t *p, const uint8_t *e) {
    while (p + 8 <= e) {
        uint64_t word;
        memcpy(&word, p, 8);
        /* a byte is a digit when its high nibble is 3 and adding 6 keeps it so */
        uint64_t not_digit = ((word & 0xF0F0F0F0F0F0F0F0ULL) ^ 0x3030303030303030ULL)
                             | (((word + 0x0606060606060606ULL) & 0xF0F0F0F0F0F0F0F0ULL) ^ 0x3030303030303030ULL);
        if (not_digit) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
            return p + (__builtin_ctzll(not_digit) >> 3);
#else
            break;
#endif
        }
        p += 8;
    }
    while (p < e && (uint8_t)(*p - '0') < 10) p++;
    return p;
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
/* the value of the eight digits at p (checked by the caller): pairs, then fours, then the eight */
static inline uint64_t eight_digits(const uint8_t *p) {
    uint64_t word;
    memcpy(&word, p, 8);
    word -= ONES * '0';
    word = word * 10 + (word >> 8);
    return (((word & 0x000000FF000000FFULL) * (100 + (1000000ULL << 32)))
            + (((word >> 16) & 0x000000FF000000FFULL) * (1 + (10000ULL << 32)))) >> 32;
}
#endif

/* past the number at c->p, its grammar checked (a skipped value: nothing computed). One that may
 * be out of a double's range (over 300 digits, or an exponent over 300) is STRAY: msgspec refuses
 * "Number out of range" where it reads it, and says so. */
static int skip_number(cur_t *c) {
    const uint8_t *p = c->p, *e = c->e, *digits;
    if (*p == '-') p++;
    if (p >= e) return MORE;
    digits = p;
    if (*p == '0') p++;
    else if (*p >= '1' && *p <= '9') p = skip_digits(p, e);
    else return BAD;
    int huge = p - digits > 300;
    if (p < e && *p == '.') {
        p++;
        if (p >= e) return MORE;
        if ((uint8_t)(*p - '0') >= 10) return BAD;
        p = skip_digits(p, e);
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        p++;
        int negative = p < e && *p == '-';
        if (p < e && (*p == '+' || *p == '-')) p++;
        if (p >= e) return MORE;
        if ((uint8_t)(*p - '0') >= 10) return BAD;
        int64_t exponent = 0;
        while (p < e && (uint8_t)(*p - '0') < 10) {
            if (exponent < 100000) exponent = exponent * 10 + (*p - '0');
            p++;
        }
        huge |= !negative && exponent > 300;
    }
    if (p >= e) return MORE;
    c->p = p;
    return huge ? STRAY : OK;
}

static int scan_number(cur_t *c, double *value, int *integral, int64_t *whole, int *fits) {
    const uint8_t *p = c->p, *e = c->e, *start = p;
    int negative = 0;
    if (p < e && *p == '-') { negative = 1; p++; }
    if (p >= e) return MORE;
    uint64_t mantissa = 0;
    int frac_digits = 0, overflow = 0;
    if (*p == '0') {
        p++;
    } else if (*p >= '1' && *p <= '9') {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        while (p + 8 <= e && mantissa < 1000000000ULL && skip_digits(p, p + 8) == p + 8) {
            mantissa = mantissa * 100000000ULL + eight_digits(p);
            p += 8;
        }
#endif
        while (p < e && *p >= '0' && *p <= '9') {
            if (mantissa < BIG) mantissa = mantissa * 10 + (uint64_t)(*p - '0'); else overflow = 1;
            p++;
        }
    } else {
        return BAD;
    }
    int has_frac = 0, has_exp = 0, exp_negative = 0;
    int64_t exponent = 0;
    if (p < e && *p == '.') {
        has_frac = 1;
        p++;
        if (p >= e) return MORE;
        if (!(*p >= '0' && *p <= '9')) return BAD;
        while (p < e && *p >= '0' && *p <= '9') {
            if (mantissa < BIG) { mantissa = mantissa * 10 + (uint64_t)(*p - '0'); frac_digits++; } else overflow = 1;
            p++;
        }
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        has_exp = 1;
        p++;
        if (p < e && (*p == '+' || *p == '-')) { exp_negative = *p == '-'; p++; }
        if (p >= e) return MORE;
        if (!(*p >= '0' && *p <= '9')) return BAD;
        while (p < e && *p >= '0' && *p <= '9') {
            if (exponent < 100000) exponent = exponent * 10 + (*p - '0');
            p++;
        }
    }
    if (p >= e) return MORE;   /* a number ends before the `,` or `}` that follows it */
    c->p = p;
    if (integral) {
        *integral = !has_frac && !has_exp;
        *fits = 0;
        if (*integral && !overflow) {
            if (!negative && mantissa <= (uint64_t)INT64_MAX) { *whole = (int64_t)mantissa; *fits = 1; }
            else if (negative && mantissa <= (uint64_t)INT64_MAX) { *whole = -(int64_t)mantissa; *fits = 1; }
        }
    }
    if (value) {
        int64_t power = (exp_negative ? -exponent : exponent) - frac_digits;
        if (!overflow && mantissa < (1ULL << 53) && power >= -22 && power <= 22) {
            double m = (double)mantissa;
            double v = power < 0 ? m / POW10[-power] : m * POW10[power];
            *value = negative ? -v : v;
        } else {
            char local[128];
            size_t n = (size_t)(p - start);
            char *text = n < sizeof local ? local : malloc(n + 1);
            if (!text) return NOMEM;
            memcpy(text, start, n);
            text[n] = 0;
            *value = strtod(text, NULL);
            if (text != local) free(text);
        }
    }
    return OK;
}

static int scan_literal(cur_t *c) {
    static const char *words[3] = {"true", "false", "null"};
    const char *word = *c->p == 't' ? words[0] : *c->p == 'f' ? words[1] : words[2];
    size_t n = strlen(word);
    for (size_t i = 0; i < n; i++) {
        if (c->p + i >= c->e) return MORE;
        if (c->p[i] != (uint8_t)word[i]) return BAD;
    }
    c->p += n;
    return OK;
}

/* past the ':' after a key (p: just past the key's closing quote) and the whitespace after it:
 * OK (c->p at the value), or why not. The usual `": "` is taken at once. */
static inline int key_colon(cur_t *c, const uint8_t *p) {
    const uint8_t *e = c->e;
    if (p + 2 < e && *p == ':') {
        if (p[1] > ' ') { c->p = p + 1; return OK; }
        if (p[1] == ' ' && p[2] > ' ') { c->p = p + 2; return OK; }
    }
    c->p = p;
    skip_ws(c);
    if (c->p >= e) return MORE;
    if (*c->p != ':') return BAD;
    c->p++;
    skip_ws(c);
    return c->p < e ? OK : MORE;
}

/* an object's key at c->p and its ':' (c->p then at the value): OK, or why not. A key of at most
 * 15 bytes without escapes (nearly all) is found with one 16-byte load. */
static inline int object_key(cur_t *c, const uint8_t **key, int64_t *key_n, int *escaped) {
    const uint8_t *end, *p = c->p;
    int status;
    if (*p != '"') return BAD;
#ifdef __SSE2__
    if (p + 17 <= c->e) {
        __m128i bytes = _mm_loadu_si128((const __m128i *)(p + 1));
        __m128i control = _mm_set1_epi8(0x1f);
        int mask = _mm_movemask_epi8(_mm_or_si128(
            _mm_or_si128(_mm_cmpeq_epi8(bytes, _mm_set1_epi8('"')), _mm_cmpeq_epi8(bytes, _mm_set1_epi8('\\'))),
            _mm_cmpeq_epi8(_mm_max_epu8(bytes, control), control)));
        if (mask) {
            int n = __builtin_ctz((unsigned)mask);
            if (p[1 + n] == '"') {   /* not a backslash or control character first: the key ends there */
                *key = p + 1;
                *key_n = n;
                *escaped = 0;
                return key_colon(c, p + n + 2);
            }
        }
    }
#endif
    p = string_run(p + 1, c->e);
    if (p < c->e && *p == '"') {
        *key = c->p + 1;
        end = p;
        *escaped = 0;
        p++;
    } else if ((status = scan_string(c, key, &end, escaped)) != OK) {   /* an escape, a control character, the end */
        return status;
    } else {
        p = c->p;
    }
    *key_n = end - *key;
    return key_colon(c, p);
}

/* after a member's or an element's value: NEXT (c->p at the next one) or CLOSED (past the `close`
 * that ends the object or array) */
enum { NEXT = 10, CLOSED = 11 };
static inline int next_item(cur_t *c, uint8_t close) {
    skip_ws(c);
    if (c->p >= c->e) return MORE;
    if (*c->p == close) { c->p++; return CLOSED; }
    if (*c->p != ',') return BAD;
    c->p++;
    skip_ws(c);
    return c->p < c->e ? NEXT : MORE;
}

/* after a member's value: next_item of an object, the usual `, "` taken at once */
static inline int object_next(cur_t *c) {
    const uint8_t *p = c->p;
    if (p + 2 < c->e && *p == ',' && p[1] == ' ' && p[2] == '"') { c->p = p + 2; return NEXT; }
    return next_item(c, '}');
}

static int skip_value(cur_t *c, int depth);

static int skip_container(cur_t *c, int depth) {
    if (depth > MAX_DEPTH) return STRAY;
    int object = *c->p == '{';
    c->p++;
    skip_ws(c);
    if (c->p >= c->e) return MORE;
    if (*c->p == (object ? '}' : ']')) { c->p++; return OK; }
    for (;;) {
        int status;
        if (object) {
            const uint8_t *key;
            int64_t key_n;
            int escaped;
            if ((status = object_key(c, &key, &key_n, &escaped)) != OK) return status;
            if ((status = skip_value(c, depth + 1)) != OK) return status;
            if ((status = object_next(c)) != NEXT) return status == CLOSED ? OK : status;
            continue;
        }
        if ((status = skip_value(c, depth + 1)) != OK) return status;
        if ((status = next_item(c, ']')) != NEXT) return status == CLOSED ? OK : status;
    }
}

/* the value at c->p (not whitespace, not the end) */
static int skip_value(cur_t *c, int depth) {
    uint8_t ch = *c->p;
    if (ch == '"') return scan_string(c, NULL, NULL, NULL);
    if (ch == '{' || ch == '[') return skip_container(c, depth);
    if (ch == '-' || (ch >= '0' && ch <= '9')) return skip_number(c);
    if (ch == 't' || ch == 'f' || ch == 'n') return scan_literal(c);
    return BAD;
}

/* ------------------------------------------------------------------ events */

/* whether the byte ends a number that is a whole JSON value (what may follow one in an object or array) */
static inline int number_end(const uint8_t *p, const uint8_t *e) {
    return p < e && ends_value[*p];
}

/* a non-negative integer of at most 19 digits that a ',', '}', ']' or whitespace ends (ts, dur,
 * tids, ids: such bytes are a whole JSON number, no fraction or exponent follows): its value in
 * *whole and c->p past it, 1; else 0, c->p anywhere (the caller reads it again the long way) */
static inline int plain_integer(cur_t *c, uint64_t *whole) {
    const uint8_t *p = c->p, *e = c->e;
    uint64_t value = 0;
    if (*p == '0') {
        p++;
    } else if ((uint8_t)(*p - '1') < 9) {
        const uint8_t *first = p;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        while (p + 8 <= e && p - first <= 8 && skip_digits(p, p + 8) == p + 8) {
            value = value * 100000000ULL + eight_digits(p);
            p += 8;
        }
#endif
        while (p < e && (uint8_t)(*p - '0') < 10 && p - first < 19) value = value * 10 + (uint64_t)(*p++ - '0');
    } else {
        return 0;
    }
    if (!number_end(p, e)) return 0;
    c->p = p;
    *whole = value;
    return 1;
}

/* past a non-negative integer of at most 300 digits that a ',', '}', ']' or whitespace ends (most of
 * the args values: ids, counts, sizes), 1; else 0 and nothing moved (skip_value reads it). */
static inline int skip_plain_integer(cur_t *c) {
    const uint8_t *p = c->p, *e = c->e;
    if (*p == '0') {
        p++;
    } else if ((uint8_t)(*p - '1') < 9) {
        p = skip_digits(p + 1, e);
        if (p - c->p > 300) return 0;
    } else {
        return 0;
    }
    if (!number_end(p, e)) return 0;
    c->p = p;
    return 1;
}

/* a value the columns do not take: skipped (its JSON still checked), then STRAY (or why it is bad) */
static int stray_value(cur_t *c, int depth) {
    int status = skip_value(c, depth);
    return status == OK ? STRAY : status;
}

/* whether a byte of [p, end) is over 0x7f; bytes up to e may be read */
static inline int has_high_byte(const uint8_t *p, const uint8_t *end, const uint8_t *e) {
#ifdef __SSE2__
    if (end - p <= 16 && p + 16 <= e) {
        unsigned mask = (unsigned)_mm_movemask_epi8(_mm_loadu_si128((const __m128i *)p));
        return (mask & ((1u << (end - p)) - 1)) != 0;
    }
#endif
    uint64_t bytes = 0;
    for (; p + 8 <= end; p += 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        bytes |= word;
    }
    while (p < end) bytes |= *p++;
    return (bytes & HIGHS) != 0;
}

/* category codes: the order of CATEGORY_CODES in scan.py */
static int category_code(const uint8_t *s, int64_t n) {
#define IS(text) (n == (int64_t)sizeof(text) - 1 && memcmp(s, text, sizeof(text) - 1) == 0)
    switch (n) {
    case 6:
        return IS("kernel") ? 3 : IS("cpu_op") ? 7 : IS("fwdbwd") ? 9 : 0;
    case 10:
        return IS("gpu_memcpy") ? 4 : IS("gpu_memset") ? 5 : 0;
    case 11:
        return IS("cuda_driver") ? 2 : 0;
    case 12:
        return IS("cuda_runtime") ? 1 : 0;
    case 15:
        return IS("user_annotation") ? 8 : 0;
    case 19:
        return IS("gpu_user_annotation") ? 6 : 0;
    default:
        return 0;
    }
#undef IS
}

#define KEY(text) (key_n == (int64_t)sizeof(text) - 1 && memcmp(key, text, sizeof(text) - 1) == 0)

/* a string or number (or null, for ts/dur) value: NaN for null */
static int timed_value(cur_t *c, double *out) {
    uint8_t ch = *c->p;
    if (ch == 'n') {
        int status = scan_literal(c);
        if (status == OK) *out = NAN;
        return status;
    }
    if (ch == '-' || (ch >= '0' && ch <= '9')) {
        const uint8_t *start = c->p;
        uint64_t whole;
        if (plain_integer(c, &whole) && whole < (1ULL << 53)) {   /* the usual µs count: exact as it is */
            *out = (double)whole;
            return OK;
        }
        c->p = start;
        int status = scan_number(c, out, NULL, NULL, NULL);
        return status == OK && isinf(*out) ? STRAY : status;   /* msgspec: "Number out of range" */
    }
    if (ch == 't' || ch == 'f' || ch == '"' || ch == '{' || ch == '[') {
        return stray_value(c, 1);
    }
    return BAD;
}

static int scan_args(cur_t *c, int64_t *correlation) {
    c->p++;
    skip_ws(c);
    if (c->p >= c->e) return MORE;
    if (*c->p == '}') { c->p++; return OK; }
    for (;;) {
        const uint8_t *key;
        int64_t key_n;
        int escaped, status;
        if ((status = object_key(c, &key, &key_n, &escaped)) != OK) return status;
        if (escaped) {   /* a key with an escape could spell one that is read */
            return stray_value(c, 2);
        }
        if (KEY("correlation")) {
            uint8_t ch = *c->p;
            if (ch == 'n') {
                if ((status = scan_literal(c)) != OK) return status;
                *correlation = INT64_MIN;
            } else if (ch == '-' || (ch >= '0' && ch <= '9')) {
                int integral, fits;
                int64_t whole = 0;
                if ((status = scan_number(c, NULL, &integral, &whole, &fits)) != OK) return status;
                if (!integral || !fits || whole == INT64_MIN) return STRAY;
                *correlation = whole;
            } else {
                return stray_value(c, 2);
            }
        } else if (!skip_plain_integer(c) && (status = skip_value(c, 2)) != OK) {
            return status;
        }
        if ((status = object_next(c)) != NEXT) return status == CLOSED ? OK : status;
    }
}

typedef struct {
    int8_t code, ph;
    double ts, dur;
    int32_t tid, name;
    int64_t correlation;
    int32_t args_lo, args_hi;
} event_t;

static int scan_event(state_t *s, cur_t *c, const uint8_t *base, event_t *ev) {
    const uint8_t *name = NULL, *name_end = NULL, *tid = NULL, *tid_end = NULL;
    ev->code = 0; ev->ph = 0; ev->ts = NAN; ev->dur = NAN; ev->tid = -1; ev->name = -1;
    ev->correlation = INT64_MIN; ev->args_lo = -1; ev->args_hi = -1;
    c->p++;   /* the '{' */
    skip_ws(c);
    if (c->p >= c->e) return MORE;
    if (*c->p != '}') {
        for (;;) {
            const uint8_t *key;
            int64_t key_n;
            int escaped, status;
            if ((status = object_key(c, &key, &key_n, &escaped)) != OK) return status;
            uint8_t ch = *c->p;
            if (escaped) {
                return stray_value(c, 1);
            }
            if (KEY("ph") || KEY("cat")) {
                const uint8_t *v, *v_end;
                int v_escaped;
                if (ch != '"') {
                    return stray_value(c, 1);
                }
                if ((status = scan_string(c, &v, &v_end, &v_escaped)) != OK) return status;
                if (v_escaped) return STRAY;
                if (has_high_byte(v, v_end, c->e)) return STRAY;   /* no category or phase: msgspec says whether it is UTF-8 */
                if (key_n == 2) {
                    ev->ph = (v_end - v == 1) ? (*v == 'X' ? 1 : *v == 's' ? 2 : *v == 'f' ? 3 : 0) : 0;
                } else {
                    ev->code = (int8_t)category_code(v, v_end - v);
                }
            } else if (KEY("ts")) {
                if ((status = timed_value(c, &ev->ts)) != OK) return status;
            } else if (KEY("dur")) {
                if ((status = timed_value(c, &ev->dur)) != OK) return status;
            } else if (KEY("name")) {
                const uint8_t *v, *v_end;
                int v_escaped;
                if (ch != '"') {
                    return stray_value(c, 1);
                }
                if ((status = scan_string(c, &v, &v_end, &v_escaped)) != OK) return status;
                name = v;
                name_end = v_end;
            } else if (KEY("tid")) {
                if (ch == '{' || ch == '[') {
                    return stray_value(c, 1);
                }
                tid = c->p;
                if (!skip_plain_integer(c) && (status = skip_value(c, 1)) != OK) return status;
                tid_end = c->p;
            } else if (KEY("args")) {
                if (ch == '{') {
                    const uint8_t *lo = c->p;
                    if ((status = scan_args(c, &ev->correlation)) != OK) return status;
                    ev->args_lo = (int32_t)(lo - base);
                    ev->args_hi = (int32_t)(c->p - base);
                } else if (ch == 'n') {
                    if ((status = scan_literal(c)) != OK) return status;
                    ev->correlation = INT64_MIN;
                    ev->args_lo = ev->args_hi = -1;
                } else {
                    return stray_value(c, 1);
                }
            } else if (!skip_plain_integer(c) && (status = skip_value(c, 1)) != OK) {
                return status;
            }
            if ((status = object_next(c)) == CLOSED) break;
            if (status != NEXT) return status;
        }
    } else {
        c->p++;   /* the '}' of {} */
    }
    if (ev->code >= 1 && ev->code <= 8 && tid) {
        if ((ev->tid = intern(&s->tids, tid, tid_end - tid)) < 0) return NOMEM;
    }
    if (ev->code >= 3 && ev->code <= 8 && name) {
        if ((ev->name = intern(&s->names, name, name_end - name)) < 0) return NOMEM;
    }
    return OK;
}

/* See the comment at the top. result: [events written, position to go on from, status] */
void strag_scan(void *state, const uint8_t *buf, int64_t len, int64_t pos, int64_t cap,
                int8_t *code, int8_t *ph, double *ts, double *dur, int32_t *tid, int32_t *name,
                int64_t *correlation, int32_t *args_lo, int32_t *args_hi, int64_t *result) {
    state_t *s = state;
    cur_t c = {buf + pos, buf + len};
    const uint8_t *base = buf + pos;
    int64_t n = 0;
    int status = FULL;
    while (n < cap) {
        const uint8_t *start = c.p;
        skip_ws(&c);
        if (c.p >= c.e) { c.p = start; status = MORE; break; }
        if (*c.p != '{') {
            status = (*c.p == '[' || *c.p == '"' || *c.p == '-' || (*c.p >= '0' && *c.p <= '9') || *c.p == 't'
                      || *c.p == 'f' || *c.p == 'n') ? STRAY : BAD;
            c.p = start;
            break;
        }
        event_t ev;
        int got = scan_event(s, &c, base, &ev);
        if (got == OK) {
            skip_ws(&c);
            if (c.p >= c.e) got = MORE;
            else if (*c.p != ',' && *c.p != ']') got = BAD;
        }
        if (got != OK) { c.p = start; status = got; break; }
        code[n] = ev.code; ph[n] = ev.ph; ts[n] = ev.ts; dur[n] = ev.dur; tid[n] = ev.tid; name[n] = ev.name;
        correlation[n] = ev.correlation; args_lo[n] = ev.args_lo; args_hi[n] = ev.args_hi;
        n++;
        if (*c.p == ']') { c.p++; status = END; break; }
        c.p++;   /* the ',' */
        /* `[..., ]` is no JSON: the next element must follow */
        const uint8_t *next = c.p;
        skip_ws(&c);
        if (c.p < c.e && *c.p == ']') { c.p = start; n--; status = BAD; break; }
        c.p = next;
    }
    result[0] = n;
    result[1] = c.p - buf;
    result[2] = status;
}
