/*
 * kiln's NCCL emulator: the NCCL calls kiln's NcclGroup makes, between processes (or threads)
 * of one machine, over Unix sockets, on the emulated device memory and streams of cuda.c. A
 * test double, so that kiln's NCCL code runs across ranks where there is no GPU; it says
 * nothing of NCCL's speed. What it keeps of NCCL's semantics, because kiln depends on them:
 *
 * - Operations run on the stream they are enqueued on, in its order, when the stream gets to
 *   them: the call returns at once; the caller learns of completion from the stream (events).
 * - A send does not complete before the peer has posted the matching receive (NCCL may block
 *   a send until then): two ranks that each send to the other before receiving, outside a
 *   group, never finish, as on GPUs. Inside ncclGroupStart/End all operations are posted
 *   together and progress together.
 * - Communicator creation: non-blocking when the config says so (ncclInProgress, polled
 *   with ncclCommGetAsyncError); two ranks on one device are refused ("Duplicate GPU
 *   detected"), as NCCL refuses them; a rank that never joins leaves the others in progress
 *   until the caller aborts.
 * - Buffers must be emulated device memory: a host pointer is ncclInvalidArgument, as NCCL's
 *   pointer check makes it. ncclAvg multiplies each rank's input by 1/n before summing, as
 *   NCCL does for floating types, so its result is not exactly the sum divided by n.
 * - A peer that exits leaves the stream stuck (ncclRemoteError in ncclCommGetAsyncError) until
 *   the communicator is aborted.
 *
 * Stricter than NCCL where NCCL's behaviour is undefined: ranks that call different
 * collectives, or different counts, types or roots, or a receive that does not match its
 * send's length, stop the process with a message naming both sides (on GPUs: a hang or
 * corrupt data).
 *
 *     cc -shared -fPIC -O2 -pthread -o libnccl.so nccl.c -L. -lcuda -Wl,-rpath,'$ORIGIN'
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "emu.h"

#define EMU_EXPORT __attribute__((visibility("default")))

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
} ncclResult_t;

enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 };
enum {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9,
};

typedef struct {
  char internal[128];
} ncclUniqueId;

/* The fields of ncclConfig_t read here (NCCL's layout, stable since 2.14). */
typedef struct {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
} config_head;

static const char ID_MAGIC[8] = "KILNEMU1";

/* ---- messages between ranks ---- */

enum { FR_HDR = 1, FR_CTS = 2, FR_DATA = 3 };
enum { K_ALLREDUCE = 1, K_ALLGATHER, K_REDUCESCATTER, K_BROADCAST, K_P2P };

static const char *kind_name(uint32_t k) {
  switch (k) {
    case K_ALLREDUCE: return "ncclAllReduce";
    case K_ALLGATHER: return "ncclAllGather";
    case K_REDUCESCATTER: return "ncclReduceScatter";
    case K_BROADCAST: return "ncclBroadcast";
    case K_P2P: return "ncclSend/ncclRecv";
    default: return "?";
  }
}

/* A frame: HDR announces a send (what the receiver must expect), CTS says the receive is
 * posted, DATA carries `bytes` of payload after it. */
typedef struct {
  uint32_t type, kind;
  uint64_t count;
  int32_t dtype, op, root, pad;
  uint64_t bytes;
} frame;

typedef struct hello {
  char magic[8];
  int32_t rank, nranks;
  uint64_t bus, host;
} hello;

/* One peer's connection, with what was read of it beyond the current operation. */
typedef struct channel {
  int fd;
  frame in;       /* the frame being read */
  size_t in_got;  /* its bytes read so far */
  char *data_dst; /* a DATA frame's payload being read: where to, and how much is left */
  uint64_t data_left;
  frame *early; /* HDRs read before this rank posted their receives */
  size_t n_early, cap_early;
  int eof; /* the peer closed its end (finished, or gone) */
} channel;

typedef struct ncclComm {
  int rank, nranks, device;
  uint64_t bus, host;
  char key[64];
  channel *peers;
  pthread_mutex_t mu; /* the fields below */
  pthread_cond_t cv;
  ncclResult_t state; /* ncclInProgress during init; the asynchronous error after */
  char last_error[512];
  int aborted;
  pthread_mutex_t exec; /* one operation of this communicator at a time */
} ncclComm;

static __thread char global_error[512];

static void set_error(ncclComm *c, ncclResult_t state, const char *fmt, ...) {
  char text[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  if (!c) {
    snprintf(global_error, sizeof global_error, "%s", text);
    return;
  }
  pthread_mutex_lock(&c->mu);
  snprintf(c->last_error, sizeof c->last_error, "%s", text);
  c->state = state;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

__attribute__((noreturn)) static void fatal(const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, "kiln-nccl-emu (pid %d): ", (int)getpid());
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\n");
  fflush(stderr);
  abort();
}

static int is_aborted(ncclComm *c) {
  pthread_mutex_lock(&c->mu);
  int a = c->aborted;
  pthread_mutex_unlock(&c->mu);
  return a;
}

/* What a GPU does when a peer is gone: the operation never completes. The stream stays here
 * until the communicator is aborted; the error is in ncclCommGetAsyncError. */
static void stuck_until_abort(ncclComm *c) {
  pthread_mutex_lock(&c->mu);
  while (!c->aborted) pthread_cond_wait(&c->cv, &c->mu);
  pthread_mutex_unlock(&c->mu);
}

static void pause_ms(int ms) {
  struct timespec t = {0, (long)ms * 1000000L};
  nanosleep(&t, NULL);
}

/* ---- versions, ids, errors ---- */

EMU_EXPORT ncclResult_t ncclGetVersion(int *version) {
  if (!version) return ncclInvalidArgument;
  *version = 22304; /* what the emulator claims to be: 2.23.4 */
  return ncclSuccess;
}

EMU_EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  if (!id) return ncclInvalidArgument;
  memset(id, 0, sizeof *id);
  memcpy(id->internal, ID_MAGIC, sizeof ID_MAGIC);
  uint64_t nonce = 0;
  int fd = open("/dev/urandom", O_RDONLY);
  if (fd < 0 || read(fd, &nonce, sizeof nonce) != (ssize_t)sizeof nonce)
    nonce = (uint64_t)getpid() ^ (uint64_t)time(NULL) << 20;
  if (fd >= 0) close(fd);
  memcpy(id->internal + 8, &nonce, sizeof nonce);
  return ncclSuccess;
}

EMU_EXPORT const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

EMU_EXPORT const char *ncclGetLastError(ncclComm *comm) {
  return comm ? comm->last_error : global_error;
}

/* ---- sockets ---- */

static void socket_address(struct sockaddr_un *a, socklen_t *len, const char *key, int rank) {
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  /* An abstract name (leading NUL): nothing to clean up in the file system. */
  int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "%s/%d", key, rank);
  *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* Reads or writes exactly `len` bytes of a blocking socket; 0 on success. */
static int read_full(int fd, void *buf, size_t len) {
  char *p = buf;
  while (len) {
    ssize_t n = read(fd, p, len);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return -1;
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static int write_full(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len) {
    ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return -1;
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static uint64_t host_hash(void) {
  char name[256] = {0};
  gethostname(name, sizeof name - 1);
  uint64_t h = 1469598103934665603ull;
  for (char *p = name; *p; p++) h = (h ^ (uint64_t)(unsigned char)*p) * 1099511628211ull;
  return h;
}

/* Builds the full mesh of connections: rank r connects to every lower rank and accepts every
 * higher one. Then checks that no two ranks of one host share a device. */
static void *init_main(void *arg) {
  ncclComm *c = arg;
  int n = c->nranks, r = c->rank;
  hello mine = {{0}, r, n, c->bus, c->host};
  memcpy(mine.magic, ID_MAGIC, sizeof ID_MAGIC);
  hello *all = calloc((size_t)n, sizeof *all);
  all[r] = mine;

  int listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un addr;
  socklen_t len;
  socket_address(&addr, &len, c->key, r);
  if (bind(listener, (struct sockaddr *)&addr, len) != 0) {
    set_error(c, ncclInvalidUsage,
              "ncclCommInitRank: rank %d of this communicator is already taken (%s)", r,
              strerror(errno));
    close(listener);
    free(all);
    return NULL;
  }
  listen(listener, n);

  for (int p = 0; p < r; p++) {
    for (;;) {
      if (is_aborted(c)) goto out;
      int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      struct sockaddr_un peer;
      socklen_t plen;
      socket_address(&peer, &plen, c->key, p);
      if (connect(s, (struct sockaddr *)&peer, plen) == 0) {
        hello theirs;
        if (write_full(s, &mine, sizeof mine) || read_full(s, &theirs, sizeof theirs)) {
          close(s);
          set_error(c, ncclRemoteError, "ncclCommInitRank: rank %d left during set-up", p);
          goto out;
        }
        all[p] = theirs;
        c->peers[p].fd = s;
        break;
      }
      close(s);
      pause_ms(2);
    }
  }
  for (int joined = r + 1; joined < n;) {
    if (is_aborted(c)) goto out;
    struct pollfd pfd = {listener, POLLIN, 0};
    if (poll(&pfd, 1, 20) <= 0) continue;
    int s = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
    if (s < 0) continue;
    hello theirs;
    if (read_full(s, &theirs, sizeof theirs) || memcmp(theirs.magic, ID_MAGIC, 8) ||
        theirs.rank <= r || theirs.rank >= n || theirs.nranks != n || c->peers[theirs.rank].fd >= 0 ||
        write_full(s, &mine, sizeof mine)) {
      close(s);
      set_error(c, ncclInvalidUsage,
                "ncclCommInitRank: a rank joined with a different rank count or twice");
      goto out;
    }
    all[theirs.rank] = theirs;
    c->peers[theirs.rank].fd = s;
    joined++;
  }
  for (int a = 0; a < n; a++)
    for (int b = a + 1; b < n; b++)
      if (all[a].host == all[b].host && all[a].bus == all[b].bus) {
        set_error(c, ncclInvalidUsage,
                  "Duplicate GPU detected : rank %d and rank %d both on CUDA device %llx", a, b,
                  (unsigned long long)all[a].bus);
        goto out;
      }
  for (int p = 0; p < n; p++)
    if (p != r) fcntl(c->peers[p].fd, F_SETFL, fcntl(c->peers[p].fd, F_GETFL) | O_NONBLOCK);
  set_error(c, ncclSuccess, "");
out:
  close(listener);
  free(all);
  return NULL;
}

EMU_EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm **comm, int nranks, ncclUniqueId id,
                                               int rank, void *config) {
  if (!comm) return ncclInvalidArgument;
  *comm = NULL;
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    set_error(NULL, ncclInvalidArgument, "ncclCommInitRank: rank %d of %d", rank, nranks);
    return ncclInvalidArgument;
  }
  if (memcmp(id.internal, ID_MAGIC, sizeof ID_MAGIC) != 0) {
    set_error(NULL, ncclInvalidArgument,
              "ncclCommInitRank: the unique id was not made by ncclGetUniqueId");
    return ncclInvalidArgument;
  }
  int blocking = 1;
  if (config) {
    const config_head *h = config;
    if (h->blocking != INT_MIN) blocking = h->blocking;
  }
  ncclComm *c = calloc(1, sizeof *c);
  c->rank = rank;
  c->nranks = nranks;
  c->device = kiln_emu_current_device();
  c->bus = kiln_emu_device_bus_id(c->device);
  c->host = host_hash();
  uint64_t nonce;
  memcpy(&nonce, id.internal + 8, sizeof nonce);
  snprintf(c->key, sizeof c->key, "kiln-nccl-emu/%016llx/%d", (unsigned long long)nonce, nranks);
  c->peers = calloc((size_t)nranks, sizeof *c->peers);
  for (int p = 0; p < nranks; p++) c->peers[p].fd = -1;
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  pthread_mutex_init(&c->exec, NULL);
  c->state = ncclInProgress;
  *comm = c;
  pthread_t t;
  pthread_create(&t, NULL, init_main, c);
  if (blocking) {
    pthread_join(t, NULL);
    return c->state;
  }
  pthread_detach(t);
  return ncclInProgress;
}

EMU_EXPORT ncclResult_t ncclCommInitRank(ncclComm **comm, int nranks, ncclUniqueId id,
                                         int rank) {
  return ncclCommInitRankConfig(comm, nranks, id, rank, NULL);
}

EMU_EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm *comm, ncclResult_t *state) {
  if (!comm || !state) return ncclInvalidArgument;
  pthread_mutex_lock(&comm->mu);
  *state = comm->state;
  pthread_mutex_unlock(&comm->mu);
  return ncclSuccess;
}

/* Aborting wakes everything waiting on the communicator (its set-up, a stuck stream) and
 * shuts its connections, so that peers see it gone. Its memory is not freed: a stream may
 * still be inside one of its operations. */
EMU_EXPORT ncclResult_t ncclCommAbort(ncclComm *comm) {
  if (!comm) return ncclSuccess;
  pthread_mutex_lock(&comm->mu);
  comm->aborted = 1;
  pthread_cond_broadcast(&comm->cv);
  pthread_mutex_unlock(&comm->mu);
  for (int p = 0; p < comm->nranks; p++)
    if (comm->peers[p].fd >= 0) shutdown(comm->peers[p].fd, SHUT_RDWR);
  return ncclSuccess;
}

EMU_EXPORT ncclResult_t ncclCommDestroy(ncclComm *comm) { return ncclCommAbort(comm); }
EMU_EXPORT ncclResult_t ncclCommFinalize(ncclComm *comm) {
  (void)comm;
  return ncclSuccess;
}

EMU_EXPORT ncclResult_t ncclCommCount(const ncclComm *comm, int *count) {
  if (!comm || !count) return ncclInvalidArgument;
  *count = comm->nranks;
  return ncclSuccess;
}

EMU_EXPORT ncclResult_t ncclCommUserRank(const ncclComm *comm, int *rank) {
  if (!comm || !rank) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}

EMU_EXPORT ncclResult_t ncclCommCuDevice(const ncclComm *comm, int *device) {
  if (!comm || !device) return ncclInvalidArgument;
  *device = comm->device;
  return ncclSuccess;
}

/* ---- element types and reductions ---- */

static size_t dtype_size(int dt) {
  switch (dt) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: return 4;
    case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

static float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else { /* subnormal: normalise */
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) {
        man <<= 1;
        exp--;
      }
      bits = sign | exp << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static uint16_t float_to_half(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
  uint32_t man = x & 0x7fffff;
  if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
  if (exp >= 31) return (uint16_t)(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10) return (uint16_t)sign;
    man |= 0x800000;
    uint32_t shift = (uint32_t)(14 - exp);
    uint32_t half = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) half++;
    return (uint16_t)(sign | half);
  }
  uint32_t h = sign | (uint32_t)exp << 10 | man >> 13, rem = man & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
  return (uint16_t)h;
}

static float bf16_to_float(uint16_t b) {
  uint32_t bits = (uint32_t)b << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static uint16_t float_to_bf16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40);
  x += 0x7fff + ((x >> 16) & 1);
  return (uint16_t)(x >> 16);
}

static double apply(int op, double a, double b) {
  switch (op) {
    case ncclProd: return a * b;
    case ncclMax: return a > b ? a : b;
    case ncclMin: return a < b ? a : b;
    default: return a + b; /* Sum, and Avg's sum of pre-scaled inputs */
  }
}

/* out[i] = inputs[0][i] op inputs[1][i] op ... in rank order, so every rank gets the same
 * bits. Floating types are combined in their own precision (f16/bf16 through f32, rounded
 * after each step); Avg pre-scales each input by 1/n, integers divide the sum. */
static void reduce(char *out, const char *const *inputs, int n, size_t count, int dt, int op) {
  double scale = op == ncclAvg ? 1.0 / n : 1.0;
  for (size_t i = 0; i < count; i++) {
    switch (dt) {
      case ncclFloat32: {
        float acc = 0;
        for (int q = 0; q < n; q++) {
          float v = ((const float *)inputs[q])[i];
          if (op == ncclAvg) v *= (float)scale;
          acc = q ? (float)apply(op, acc, v) : v;
        }
        ((float *)out)[i] = acc;
        break;
      }
      case ncclFloat64: {
        double acc = 0;
        for (int q = 0; q < n; q++) {
          double v = ((const double *)inputs[q])[i] * scale;
          acc = q ? apply(op, acc, v) : v;
        }
        ((double *)out)[i] = acc;
        break;
      }
      case ncclFloat16:
      case ncclBfloat16: {
        int half = dt == ncclFloat16;
        float acc = 0;
        for (int q = 0; q < n; q++) {
          uint16_t raw = ((const uint16_t *)inputs[q])[i];
          float v = half ? half_to_float(raw) : bf16_to_float(raw);
          if (op == ncclAvg) v = half ? half_to_float(float_to_half(v * (float)scale))
                                      : bf16_to_float(float_to_bf16(v * (float)scale));
          acc = q ? (float)apply(op, acc, v) : v;
          acc = half ? half_to_float(float_to_half(acc)) : bf16_to_float(float_to_bf16(acc));
        }
        ((uint16_t *)out)[i] = half ? float_to_half(acc) : float_to_bf16(acc);
        break;
      }
      case ncclInt64:
      case ncclInt32:
      case ncclUint8: {
        int64_t acc = 0;
        for (int q = 0; q < n; q++) {
          int64_t v = dt == ncclInt64   ? ((const int64_t *)inputs[q])[i]
                      : dt == ncclInt32 ? ((const int32_t *)inputs[q])[i]
                                        : ((const uint8_t *)inputs[q])[i];
          if (!q) acc = v;
          else if (op == ncclProd) acc *= v;
          else if (op == ncclMax) acc = acc > v ? acc : v;
          else if (op == ncclMin) acc = acc < v ? acc : v;
          else acc += v;
        }
        if (op == ncclAvg) acc /= n;
        if (dt == ncclInt64) ((int64_t *)out)[i] = acc;
        else if (dt == ncclInt32) ((int32_t *)out)[i] = (int32_t)acc;
        else ((uint8_t *)out)[i] = (uint8_t)acc;
        break;
      }
      default:
        fatal("reduction over NCCL data type %d is not emulated", dt);
    }
  }
}

/* ---- operations, groups, the engine ---- */

typedef struct op {
  uint32_t kind;
  ncclComm *comm;
  const char *send;
  char *recv;
  size_t count;
  int dtype, redop, root, peer, is_send; /* peer, is_send: point-to-point */
  void *stream;
  char **tmp; /* per rank: received inputs of a reduction */
} op;

/* One transfer to or from a peer: what the engine moves. */
typedef struct xfer {
  int is_send;
  ncclComm *comm;
  int peer;
  char *buf;
  frame desc;
  int state; /* send: 0 HDR queued, 1 DATA queued, 2 written; recv: 0 posted, 1 CTS sent, 2 read */
} xfer;

typedef struct chunk {
  frame head; /* written first when `with_head` */
  int with_head;
  const char *data;
  uint64_t len; /* payload */
  uint64_t off; /* of sizeof(frame) + len */
  xfer *done;   /* marked written when the chunk is out */
  struct chunk *next;
} chunk;

typedef struct peer_link {
  ncclComm *comm;
  int peer;
  chunk *out, *out_tail;
  xfer **wait_cts; /* sends whose HDR is out, in order */
  size_t n_wait_cts, first_wait_cts;
  xfer **wait_data; /* receives whose CTS is queued, in order */
  size_t n_wait_data, first_wait_data;
} peer_link;

static void queue_chunk(peer_link *l, const frame *head, const char *data, uint64_t len, xfer *done) {
  chunk *c = calloc(1, sizeof *c);
  if (head) {
    c->head = *head;
    c->with_head = 1;
  }
  c->data = data;
  c->len = len;
  c->done = done;
  if (l->out_tail)
    l->out_tail->next = c;
  else
    l->out = c;
  l->out_tail = c;
}

static int same_desc(const frame *a, const frame *b) {
  return a->kind == b->kind && a->count == b->count && a->dtype == b->dtype && a->op == b->op &&
         a->root == b->root && a->bytes == b->bytes;
}

static void mismatch(ncclComm *c, int peer, const frame *expected, const frame *got) {
  fatal("rank %d posted %s (count %llu, type %d, op %d, root %d) where rank %d sent %s "
        "(count %llu, type %d, op %d, root %d): the ranks called different operations",
        c->rank, kind_name(expected->kind), (unsigned long long)expected->count,
        expected->dtype, expected->op, expected->root, peer, kind_name(got->kind),
        (unsigned long long)got->count, got->dtype, got->op, got->root);
}

/* Posts a receive against an HDR: checks it, queues the CTS. */
static void accept_hdr(peer_link *l, xfer *x, const frame *hdr) {
  if (!same_desc(&x->desc, hdr)) mismatch(l->comm, l->peer, &x->desc, hdr);
  frame cts = {FR_CTS, hdr->kind, 0, 0, 0, 0, 0, 0};
  queue_chunk(l, &cts, NULL, 0, NULL);
  l->wait_data[l->n_wait_data++] = x;
  x->state = 1;
}

/* Whether a link still has bytes to move this run. */
static int link_pending(const peer_link *l, const xfer *xs, size_t nx) {
  if (l->out) return 1;
  for (size_t i = 0; i < nx; i++)
    if (xs[i].comm == l->comm && xs[i].peer == l->peer && xs[i].state != 2) return 1;
  return 0;
}

/* Moves every transfer of `xs` to completion. 0, or -1 when a peer is gone or a
 * communicator aborted (then the error is set on it). */
static int run_engine(xfer *xs, size_t nx) {
  size_t nlinks = 0;
  peer_link *links = calloc(nx ? nx : 1, sizeof *links);
  for (size_t i = 0; i < nx; i++) {
    size_t j = 0;
    while (j < nlinks && !(links[j].comm == xs[i].comm && links[j].peer == xs[i].peer)) j++;
    if (j == nlinks) {
      links[j].comm = xs[i].comm;
      links[j].peer = xs[i].peer;
      links[j].wait_cts = calloc(nx, sizeof(xfer *));
      links[j].wait_data = calloc(nx, sizeof(xfer *));
      nlinks++;
    }
  }
  /* HDRs for every send, in order. */
  for (size_t i = 0; i < nx; i++) {
    if (!xs[i].is_send) continue;
    peer_link *l = links;
    while (!(l->comm == xs[i].comm && l->peer == xs[i].peer)) l++;
    queue_chunk(l, &xs[i].desc, NULL, 0, NULL);
    l->wait_cts[l->n_wait_cts++] = &xs[i];
  }
  struct pollfd *pfds = calloc(nlinks ? nlinks : 1, sizeof *pfds);
  int result = 0;
  for (;;) {
    /* Post receives against HDRs already read (earlier, or in this loop). */
    for (size_t k = 0; k < nlinks; k++) {
      peer_link *l = &links[k];
      channel *ch = &l->comm->peers[l->peer];
      for (size_t i = 0; i < nx && ch->n_early; i++) {
        xfer *x = &xs[i];
        if (x->is_send || x->state != 0 || x->comm != l->comm || x->peer != l->peer) continue;
        frame hdr = ch->early[0];
        memmove(ch->early, ch->early + 1, --ch->n_early * sizeof *ch->early);
        accept_hdr(l, x, &hdr);
      }
    }
    int pending = 0;
    for (size_t i = 0; i < nx; i++) pending += xs[i].state != 2;
    for (size_t k = 0; k < nlinks; k++) pending += links[k].out != NULL;
    if (!pending) break;

    for (size_t k = 0; k < nlinks; k++) {
      channel *ch = &links[k].comm->peers[links[k].peer];
      pfds[k].fd = ch->eof ? -1 : ch->fd;
      pfds[k].events = (short)(POLLIN | (links[k].out ? POLLOUT : 0));
      pfds[k].revents = 0;
    }
    poll(pfds, nlinks, 100);
    for (size_t k = 0; k < nlinks; k++) {
      peer_link *l = &links[k];
      ncclComm *c = l->comm;
      channel *ch = &c->peers[l->peer];
      if (is_aborted(c)) {
        result = -1;
        goto done;
      }
      /* Write what is queued. */
      while (l->out) {
        chunk *o = l->out;
        size_t head = o->with_head ? sizeof(frame) : 0;
        ssize_t n;
        if (o->off < head)
          n = send(ch->fd, (const char *)&o->head + o->off, head - o->off, MSG_NOSIGNAL);
        else if (o->off < head + o->len)
          n = send(ch->fd, o->data + (o->off - head), (size_t)(head + o->len - o->off),
                   MSG_NOSIGNAL);
        else
          n = 0;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
        if (n < 0) goto peer_gone;
        o->off += (uint64_t)n;
        if (o->off < head + o->len) continue;
        if (o->done) o->done->state = 2;
        l->out = o->next;
        if (!l->out) l->out_tail = NULL;
        free(o);
      }
      /* Read what has come. */
      for (;;) {
        ssize_t n;
        if (ch->data_left) {
          n = read(ch->fd, ch->data_dst, ch->data_left);
          if (n > 0) {
            ch->data_dst += n;
            ch->data_left -= (uint64_t)n;
            if (!ch->data_left) l->wait_data[l->first_wait_data++]->state = 2;
            continue;
          }
        } else {
          n = read(ch->fd, (char *)&ch->in + ch->in_got, sizeof(frame) - ch->in_got);
          if (n > 0) {
            ch->in_got += (size_t)n;
            if (ch->in_got < sizeof(frame)) continue;
            ch->in_got = 0;
            frame f = ch->in;
            if (f.type == FR_HDR) {
              if (ch->n_early == ch->cap_early) {
                ch->cap_early = ch->cap_early ? 2 * ch->cap_early : 16;
                ch->early = realloc(ch->early, ch->cap_early * sizeof *ch->early);
              }
              ch->early[ch->n_early++] = f;
            } else if (f.type == FR_CTS) {
              if (l->first_wait_cts == l->n_wait_cts)
                fatal("rank %d: a clear-to-send from rank %d for no send", c->rank, l->peer);
              xfer *x = l->wait_cts[l->first_wait_cts++];
              frame data = {FR_DATA, x->desc.kind, 0, 0, 0, 0, 0, x->desc.bytes};
              queue_chunk(l, &data, x->buf, x->desc.bytes, x);
              x->state = 1;
            } else if (f.type == FR_DATA) {
              if (l->first_wait_data == l->n_wait_data)
                fatal("rank %d: data from rank %d for no receive", c->rank, l->peer);
              xfer *x = l->wait_data[l->first_wait_data];
              if (f.bytes != x->desc.bytes)
                fatal("rank %d: %llu bytes from rank %d for a %llu-byte receive", c->rank,
                      (unsigned long long)f.bytes, l->peer,
                      (unsigned long long)x->desc.bytes);
              if (!f.bytes) {
                x->state = 2;
                l->first_wait_data++;
              } else {
                ch->data_dst = x->buf;
                ch->data_left = f.bytes;
              }
            } else {
              fatal("rank %d: a frame of unknown type %u from rank %d", c->rank, f.type,
                    l->peer);
            }
            continue;
          }
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
        /* The peer closed its end: harmless if it owes this link nothing (a rank that is
         * done may exit while others finish), a lost peer otherwise. */
        ch->eof = 1;
        break;
      }
      if (ch->eof && link_pending(l, xs, nx)) goto peer_gone;
      continue;
    peer_gone:
      if (is_aborted(c)) {
        result = -1;
        goto done;
      }
      set_error(c, ncclRemoteError, "rank %d: peer rank %d closed its connection (it exited or "
                "aborted its communicator)", c->rank, l->peer);
      stuck_until_abort(c);
      result = -1;
      goto done;
    }
  }
done:
  for (size_t k = 0; k < nlinks; k++) {
    while (links[k].out) {
      chunk *o = links[k].out;
      links[k].out = o->next;
      free(o);
    }
    free(links[k].wait_cts);
    free(links[k].wait_data);
  }
  free(links);
  free(pfds);
  return result;
}

typedef struct task {
  op *ops;
  size_t n;
} task;

static int cmp_comm(const void *a, const void *b) {
  uintptr_t x = (uintptr_t) * (ncclComm *const *)a, y = (uintptr_t) * (ncclComm *const *)b;
  return x < y ? -1 : x > y;
}

/* Runs a group of operations on the stream that reached it. */
static void run_task(void *arg) {
  task *t = arg;
  /* One operation per communicator at a time (locks taken in address order). */
  ncclComm **comms = calloc(t->n, sizeof *comms);
  size_t ncomms = 0;
  for (size_t i = 0; i < t->n; i++) {
    size_t j = 0;
    while (j < ncomms && comms[j] != t->ops[i].comm) j++;
    if (j == ncomms) comms[ncomms++] = t->ops[i].comm;
  }
  qsort(comms, ncomms, sizeof *comms, cmp_comm);
  for (size_t j = 0; j < ncomms; j++) pthread_mutex_lock(&comms[j]->exec);

  size_t cap = 0;
  for (size_t i = 0; i < t->n; i++) cap += 2 * (size_t)t->ops[i].comm->nranks;
  xfer *xs = calloc(cap ? cap : 1, sizeof *xs);
  size_t nx = 0;
  /* Point-to-point with this rank itself: sends and receives matched in order, copied. */
  for (size_t i = 0; i < t->n; i++) {
    op *o = &t->ops[i];
    size_t es = dtype_size(o->dtype), bytes = o->count * es;
    int n = o->comm->nranks, r = o->comm->rank;
    frame desc = {FR_HDR, o->kind, o->count, o->dtype, o->redop, o->root, 0, 0};
    switch (o->kind) {
      case K_P2P:
        desc.op = desc.root = 0;
        desc.bytes = bytes;
        if (o->peer == r) break;
        xs[nx++] = (xfer){o->is_send, o->comm, o->peer,
                          o->is_send ? (char *)o->send : o->recv, desc, 0};
        break;
      case K_ALLREDUCE:
      case K_REDUCESCATTER:
        desc.bytes = bytes;
        o->tmp = calloc((size_t)n, sizeof(char *));
        for (int p = 0; p < n; p++) {
          if (p == r) continue;
          o->tmp[p] = malloc(bytes ? bytes : 1);
          const char *src = o->kind == K_ALLREDUCE ? o->send : o->send + (size_t)p * bytes;
          xs[nx++] = (xfer){1, o->comm, p, (char *)src, desc, 0};
          xs[nx++] = (xfer){0, o->comm, p, o->tmp[p], desc, 0};
        }
        break;
      case K_ALLGATHER:
        desc.bytes = bytes;
        for (int p = 0; p < n; p++) {
          if (p == r) continue;
          xs[nx++] = (xfer){1, o->comm, p, (char *)o->send, desc, 0};
          xs[nx++] = (xfer){0, o->comm, p, o->recv + (size_t)p * bytes, desc, 0};
        }
        break;
      case K_BROADCAST:
        desc.bytes = bytes;
        if (r == o->root) {
          for (int p = 0; p < n; p++)
            if (p != r) xs[nx++] = (xfer){1, o->comm, p, (char *)o->send, desc, 0};
        } else {
          xs[nx++] = (xfer){0, o->comm, o->root, o->recv, desc, 0};
        }
        break;
    }
  }
  /* Sends to self, matched with receives from self in order. */
  {
    size_t next_recv = 0;
    for (size_t i = 0; i < t->n; i++) {
      op *s = &t->ops[i];
      if (s->kind != K_P2P || !s->is_send || s->peer != s->comm->rank) continue;
      while (next_recv < t->n &&
             !(t->ops[next_recv].kind == K_P2P && !t->ops[next_recv].is_send &&
               t->ops[next_recv].peer == t->ops[next_recv].comm->rank &&
               t->ops[next_recv].comm == s->comm))
        next_recv++;
      if (next_recv == t->n)
        fatal("rank %d: a send to itself without a receive from itself in the same group",
              s->comm->rank);
      op *d = &t->ops[next_recv++];
      if (d->count != s->count || d->dtype != s->dtype)
        fatal("rank %d: a send to itself of %zu elements (type %d) received as %zu (type %d)",
              s->comm->rank, s->count, s->dtype, d->count, d->dtype);
      memmove(d->recv, s->send, s->count * dtype_size(s->dtype));
    }
  }
  int ok = run_engine(xs, nx) == 0;
  for (size_t i = 0; ok && i < t->n; i++) {
    op *o = &t->ops[i];
    size_t es = dtype_size(o->dtype), bytes = o->count * es;
    int n = o->comm->nranks, r = o->comm->rank;
    switch (o->kind) {
      case K_ALLREDUCE:
      case K_REDUCESCATTER: {
        const char **inputs = calloc((size_t)n, sizeof *inputs);
        for (int p = 0; p < n; p++)
          inputs[p] = p == r ? (o->kind == K_ALLREDUCE ? o->send : o->send + (size_t)r * bytes)
                             : o->tmp[p];
        char *acc = malloc(bytes ? bytes : 1);
        reduce(acc, inputs, n, o->count, o->dtype, o->redop);
        memcpy(o->recv, acc, bytes);
        free(acc);
        free(inputs);
        break;
      }
      case K_ALLGATHER:
        memmove(o->recv + (size_t)r * bytes, o->send, bytes);
        break;
      case K_BROADCAST:
        if (r == o->root) memmove(o->recv, o->send, bytes);
        break;
    }
  }
  for (size_t i = 0; i < t->n; i++) {
    if (!t->ops[i].tmp) continue;
    for (int p = 0; p < t->ops[i].comm->nranks; p++) free(t->ops[i].tmp[p]);
    free(t->ops[i].tmp);
  }
  for (size_t j = ncomms; j-- > 0;) pthread_mutex_unlock(&comms[j]->exec);
  free(comms);
  free(xs);
  free(t->ops);
  free(t);
}

static __thread int group_depth;
static __thread op *group_ops;
static __thread size_t group_n, group_cap;

static ncclResult_t submit(op o) {
  if (group_depth) {
    if (group_n == group_cap) {
      group_cap = group_cap ? 2 * group_cap : 16;
      group_ops = realloc(group_ops, group_cap * sizeof *group_ops);
    }
    group_ops[group_n++] = o;
    return ncclSuccess;
  }
  task *t = malloc(sizeof *t);
  t->ops = malloc(sizeof(op));
  t->ops[0] = o;
  t->n = 1;
  kiln_emu_enqueue(o.stream, run_task, t);
  return ncclSuccess;
}

EMU_EXPORT ncclResult_t ncclGroupStart(void) {
  group_depth++;
  return ncclSuccess;
}

EMU_EXPORT ncclResult_t ncclGroupEnd(void) {
  if (!group_depth) {
    set_error(NULL, ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    return ncclInvalidUsage;
  }
  if (--group_depth || !group_n) return ncclSuccess;
  for (size_t i = 1; i < group_n; i++)
    if (group_ops[i].stream != group_ops[0].stream)
      fatal("a group over several streams is not emulated");
  task *t = malloc(sizeof *t);
  t->ops = group_ops;
  t->n = group_n;
  group_ops = NULL;
  group_n = group_cap = 0;
  kiln_emu_enqueue(t->ops[0].stream, run_task, t);
  return ncclSuccess;
}

/* The checks NCCL makes when an operation is enqueued. */
static ncclResult_t check(ncclComm *c, const char *what, const void *buf, size_t bytes,
                          int dtype) {
  if (!c) {
    set_error(NULL, ncclInvalidArgument, "%s: no communicator", what);
    return ncclInvalidArgument;
  }
  pthread_mutex_lock(&c->mu);
  ncclResult_t state = c->state;
  int aborted = c->aborted;
  pthread_mutex_unlock(&c->mu);
  if (aborted || state == ncclInProgress) {
    set_error(c, state, "%s on a communicator %s", what, aborted ? "aborted" : "not ready");
    return ncclInvalidUsage;
  }
  if (state != ncclSuccess) return state;
  if (!dtype_size(dtype)) {
    snprintf(c->last_error, sizeof c->last_error, "%s: invalid data type %d", what, dtype);
    return ncclInvalidArgument;
  }
  if (bytes && !kiln_emu_is_device(buf, bytes)) {
    snprintf(c->last_error, sizeof c->last_error,
             "%s: buffer %p (%zu bytes) is not device memory of this process", what, buf,
             bytes);
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

#define CHECK(c, what, buf, bytes, dt)                              \
  do {                                                              \
    ncclResult_t r_ = check((c), (what), (buf), (bytes), (dt));     \
    if (r_ != ncclSuccess) return r_;                               \
  } while (0)

EMU_EXPORT ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, int dtype,
                                      int redop, ncclComm *comm, void *stream) {
  size_t b = count * dtype_size(dtype);
  CHECK(comm, "ncclAllReduce", send, b, dtype);
  CHECK(comm, "ncclAllReduce", recv, b, dtype);
  if (!count) return ncclSuccess;
  return submit((op){K_ALLREDUCE, comm, send, recv, count, dtype, redop, 0, 0, 0, stream, 0});
}

EMU_EXPORT ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, int dtype,
                                      ncclComm *comm, void *stream) {
  size_t b = count * dtype_size(dtype);
  CHECK(comm, "ncclAllGather", send, b, dtype);
  CHECK(comm, "ncclAllGather", recv, b * (size_t)(comm ? comm->nranks : 0), dtype);
  if (!count) return ncclSuccess;
  return submit((op){K_ALLGATHER, comm, send, recv, count, dtype, 0, 0, 0, 0, stream, 0});
}

EMU_EXPORT ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, int dtype,
                                          int redop, ncclComm *comm, void *stream) {
  size_t b = count * dtype_size(dtype);
  CHECK(comm, "ncclReduceScatter", send, b * (size_t)(comm ? comm->nranks : 0), dtype);
  CHECK(comm, "ncclReduceScatter", recv, b, dtype);
  if (!count) return ncclSuccess;
  return submit(
      (op){K_REDUCESCATTER, comm, send, recv, count, dtype, redop, 0, 0, 0, stream, 0});
}

EMU_EXPORT ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, int dtype,
                                      int root, ncclComm *comm, void *stream) {
  size_t b = count * dtype_size(dtype);
  if (comm && (root < 0 || root >= comm->nranks)) return ncclInvalidArgument;
  if (comm && comm->rank == root) CHECK(comm, "ncclBroadcast", send, b, dtype);
  CHECK(comm, "ncclBroadcast", recv, b, dtype);
  if (!count) return ncclSuccess;
  return submit((op){K_BROADCAST, comm, send, recv, count, dtype, 0, root, 0, 0, stream, 0});
}

EMU_EXPORT ncclResult_t ncclSend(const void *send, size_t count, int dtype, int peer,
                                 ncclComm *comm, void *stream) {
  CHECK(comm, "ncclSend", send, count * dtype_size(dtype), dtype);
  if (peer < 0 || peer >= comm->nranks) return ncclInvalidArgument;
  return submit((op){K_P2P, comm, send, NULL, count, dtype, 0, 0, peer, 1, stream, 0});
}

EMU_EXPORT ncclResult_t ncclRecv(void *recv, size_t count, int dtype, int peer, ncclComm *comm,
                                 void *stream) {
  CHECK(comm, "ncclRecv", recv, count * dtype_size(dtype), dtype);
  if (peer < 0 || peer >= comm->nranks) return ncclInvalidArgument;
  return submit((op){K_P2P, comm, NULL, recv, count, dtype, 0, 0, peer, 0, stream, 0});
}
