/*
 * kiln's CUDA driver emulator: the part of libcuda.so that cudarc's safe API and kiln's
 * NcclGroup use, on host memory, so that kiln's NCCL code runs across processes on a machine
 * without a GPU (with nccl.c, the NCCL emulator). A test double, not a GPU: no kernels, no
 * modules, no NVRTC. What it keeps of CUDA's semantics, because kiln's correctness depends on
 * them:
 *
 * - Streams are asynchronous: every stream is a worker thread running its queue in order
 *   (copies, event records, waits, NCCL operations). A copy from "device" to host is only
 *   done when the stream reaches it, so a caller that reads before synchronising reads stale
 *   bytes, as on a GPU.
 * - Events are recorded in stream order; cuEventQuery answers CUDA_ERROR_NOT_READY until the
 *   stream has passed the record.
 * - Device memory is a registry of allocations: nccl.c refuses a pointer outside them (a host
 *   buffer handed to NCCL), and cuMemAlloc(0) is CUDA_ERROR_INVALID_VALUE, as on a GPU.
 *   Memory pools are supported (as on the GPUs kiln targets): cudarc then frees in stream
 *   order (cuMemFreeAsync) instead of synchronising the stream first; KILN_CUDA_EMU_NO_POOLS
 *   makes a GPU without them.
 * - Copies from and to pageable host memory follow CUDA's documented rules (see
 *   cuMemcpyHtoDAsync_v2 below).
 * - Devices: as many as CUDA_VISIBLE_DEVICES lists, else KILN_CUDA_EMU_DEVICES (default 8).
 *   A device's identity (its bus id, which NCCL compares to refuse two ranks on one GPU) is the
 *   CUDA_VISIBLE_DEVICES entry at its ordinal, or the ordinal.
 *
 * Built by kiln's emulated-NCCL tests (crates/comm/emu/README.md):
 *     cc -shared -fPIC -O2 -pthread -o libcuda.so cuda.c
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "emu.h"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_NOT_SUPPORTED = 801,
};

#define EMU_EXPORT __attribute__((visibility("default")))

/* ---- devices and contexts ---- */

#define MAX_DEVICES 64

typedef struct emu_ctx {
  uint32_t magic;
  int device;
} emu_ctx;

static emu_ctx primary[MAX_DEVICES];
static int initialised;
static __thread emu_ctx *current;
static __thread emu_ctx *ctx_stack[16];
static __thread int ctx_depth;

static int device_count(void) {
  const char *visible = getenv("CUDA_VISIBLE_DEVICES");
  if (visible) {
    int n = 0;
    const char *p = visible;
    while (*p == ' ') p++;
    if (*p == '\0') return 0;
    for (; *p; p++)
      if (*p == ',') n++;
    return n + 1 > MAX_DEVICES ? MAX_DEVICES : n + 1;
  }
  const char *n = getenv("KILN_CUDA_EMU_DEVICES");
  int count = n ? atoi(n) : 8;
  return count < 0 ? 0 : count > MAX_DEVICES ? MAX_DEVICES : count;
}

/* The physical identity of device `ordinal`: the entry CUDA_VISIBLE_DEVICES lists there (a
 * number, or a hash of a UUID), else the ordinal. */
EMU_EXPORT uint64_t kiln_emu_device_bus_id(int ordinal) {
  const char *visible = getenv("CUDA_VISIBLE_DEVICES");
  if (!visible) return (uint64_t)ordinal;
  const char *p = visible;
  for (int i = 0; i < ordinal && p; i++) {
    p = strchr(p, ',');
    if (p) p++;
  }
  if (!p) return (uint64_t)ordinal;
  uint64_t h = 1469598103934665603ull;
  int numeric = 1;
  uint64_t v = 0;
  for (; *p && *p != ','; p++) {
    if (*p == ' ') continue;
    if (*p >= '0' && *p <= '9')
      v = v * 10 + (uint64_t)(*p - '0');
    else
      numeric = 0;
    h = (h ^ (uint64_t)(unsigned char)*p) * 1099511628211ull;
  }
  return numeric ? v : h;
}

EMU_EXPORT int kiln_emu_current_device(void) { return current ? current->device : 0; }

EMU_EXPORT CUresult cuInit(unsigned int flags) {
  (void)flags;
  initialised = 1;
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuDriverGetVersion(int *version) {
  if (!version) return CUDA_ERROR_INVALID_VALUE;
  *version = 12080;
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuDeviceGetCount(int *count) {
  if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
  if (!count) return CUDA_ERROR_INVALID_VALUE;
  *count = device_count();
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
  if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
  if (!device) return CUDA_ERROR_INVALID_VALUE;
  if (ordinal < 0 || ordinal >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice device) {
  if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  snprintf(name, (size_t)len, "kiln emulated GPU %d", device);
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device) {
  (void)device;
  if (!value) return CUDA_ERROR_INVALID_VALUE;
  switch (attribute) {
    case 115: /* CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, as on the GPUs kiln targets */
      *value = getenv("KILN_CUDA_EMU_NO_POOLS") ? 0 : 1;
      break;
    default:
      *value = 0;
  }
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuDevicePrimaryCtxRetain(emu_ctx **ctx, CUdevice device) {
  if (!ctx) return CUDA_ERROR_INVALID_VALUE;
  if (device < 0 || device >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
  primary[device].magic = 0x6b696c6e;
  primary[device].device = device;
  *ctx = &primary[device];
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
  (void)device;
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuCtxSetCurrent(emu_ctx *ctx) {
  current = ctx;
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuCtxGetCurrent(emu_ctx **ctx) {
  if (!ctx) return CUDA_ERROR_INVALID_VALUE;
  *ctx = current;
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuCtxPushCurrent_v2(emu_ctx *ctx) {
  if (ctx_depth == 16) return CUDA_ERROR_INVALID_VALUE;
  ctx_stack[ctx_depth++] = current;
  current = ctx;
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuCtxPopCurrent_v2(emu_ctx **ctx) {
  if (ctx) *ctx = current;
  current = ctx_depth ? ctx_stack[--ctx_depth] : NULL;
  return CUDA_SUCCESS;
}

/* ---- device memory: a registry of host allocations ---- */

typedef struct alloc_entry {
  uintptr_t base;
  size_t size;
} alloc_entry;

static pthread_mutex_t allocs_mu = PTHREAD_MUTEX_INITIALIZER;
static alloc_entry *allocs;
static size_t n_allocs, cap_allocs;

/* Whether [ptr, ptr + bytes) lies inside one live device allocation. */
EMU_EXPORT int kiln_emu_is_device(const void *ptr, size_t bytes) {
  uintptr_t p = (uintptr_t)ptr;
  int found = 0;
  pthread_mutex_lock(&allocs_mu);
  for (size_t i = 0; i < n_allocs && !found; i++)
    found = p >= allocs[i].base && p + bytes <= allocs[i].base + allocs[i].size;
  pthread_mutex_unlock(&allocs_mu);
  return found;
}

EMU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
  if (!dptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  void *p = malloc(bytes);
  if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
  /* Fresh device memory holds garbage, not zeros: kiln must not rely on either. */
  memset(p, 0xA5, bytes);
  pthread_mutex_lock(&allocs_mu);
  if (n_allocs == cap_allocs) {
    cap_allocs = cap_allocs ? 2 * cap_allocs : 256;
    allocs = realloc(allocs, cap_allocs * sizeof *allocs);
  }
  allocs[n_allocs++] = (alloc_entry){(uintptr_t)p, bytes};
  pthread_mutex_unlock(&allocs_mu);
  *dptr = (CUdeviceptr)(uintptr_t)p;
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
  if (!dptr) return CUDA_SUCCESS;
  pthread_mutex_lock(&allocs_mu);
  size_t i = 0;
  while (i < n_allocs && allocs[i].base != (uintptr_t)dptr) i++;
  if (i == n_allocs) {
    pthread_mutex_unlock(&allocs_mu);
    return CUDA_ERROR_INVALID_VALUE;
  }
  allocs[i] = allocs[--n_allocs];
  pthread_mutex_unlock(&allocs_mu);
  free((void *)(uintptr_t)dptr);
  return CUDA_SUCCESS;
}

/* ---- streams: a worker thread each ---- */

typedef struct task {
  void (*run)(void *);
  void *arg;
  struct task *next;
} task;

typedef struct emu_stream {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  task *head, *tail;
  int busy;
  pthread_t worker;
} emu_stream;

static void *stream_main(void *arg) {
  emu_stream *s = arg;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (!s->head) pthread_cond_wait(&s->cv, &s->mu);
    task *t = s->head;
    s->head = t->next;
    if (!s->head) s->tail = NULL;
    s->busy = 1;
    pthread_mutex_unlock(&s->mu);
    t->run(t->arg);
    free(t);
    pthread_mutex_lock(&s->mu);
    s->busy = 0;
    pthread_cond_broadcast(&s->cv);
  }
  return NULL;
}

static emu_stream *stream_new(void) {
  emu_stream *s = calloc(1, sizeof *s);
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_create(&s->worker, &attr, stream_main, s);
  pthread_attr_destroy(&attr);
  return s;
}

static pthread_once_t default_once = PTHREAD_ONCE_INIT;
static emu_stream *default_stream;
static void make_default(void) { default_stream = stream_new(); }

/* The legacy and per-thread default streams (handles 0, 1, 2) are one stream here. */
EMU_EXPORT emu_stream *kiln_emu_stream(void *handle) {
  if ((uintptr_t)handle <= 2) {
    pthread_once(&default_once, make_default);
    return default_stream;
  }
  return handle;
}

EMU_EXPORT void kiln_emu_enqueue(void *handle, void (*run)(void *), void *arg) {
  emu_stream *s = kiln_emu_stream(handle);
  task *t = malloc(sizeof *t);
  t->run = run;
  t->arg = arg;
  t->next = NULL;
  pthread_mutex_lock(&s->mu);
  if (s->tail)
    s->tail->next = t;
  else
    s->head = t;
  s->tail = t;
  pthread_cond_signal(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

EMU_EXPORT CUresult cuStreamCreate(emu_stream **stream, unsigned int flags) {
  (void)flags;
  if (!stream) return CUDA_ERROR_INVALID_VALUE;
  *stream = stream_new();
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuStreamCreateWithPriority(emu_stream **stream, unsigned int flags,
                                               int priority) {
  (void)priority;
  return cuStreamCreate(stream, flags);
}

EMU_EXPORT CUresult cuStreamSynchronize(emu_stream *handle) {
  emu_stream *s = kiln_emu_stream(handle);
  pthread_mutex_lock(&s->mu);
  while (s->head || s->busy) pthread_cond_wait(&s->cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
  return CUDA_SUCCESS;
}

/* A stream's worker is left running (detached, idle): work still queued on a destroyed stream
 * completes, as CUDA promises. */
EMU_EXPORT CUresult cuStreamDestroy_v2(emu_stream *handle) {
  (void)handle;
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuCtxSynchronize(void) {
  /* Only the default stream is known by name here; kiln synchronises its own streams. */
  return cuStreamSynchronize(NULL);
}

/* ---- copies, in stream order ---- */

typedef struct copy_args {
  void *dst;
  const void *src;
  size_t bytes;
  void *staged; /* a copy of pageable host memory, freed after */
  int set;      /* a memset of `value` instead */
  unsigned char value;
} copy_args;

static void run_copy(void *arg) {
  copy_args *c = arg;
  if (c->set)
    memset(c->dst, c->value, c->bytes);
  else
    memmove(c->dst, c->src, c->bytes);
  free(c->staged);
  free(c);
}

static CUresult enqueue_copy(void *dst, const void *src, size_t bytes, void *stream) {
  copy_args *c = calloc(1, sizeof *c);
  c->dst = dst;
  c->src = src;
  c->bytes = bytes;
  kiln_emu_enqueue(stream, run_copy, c);
  return CUDA_SUCCESS;
}

#define DEV(p) ((void *)(uintptr_t)(p))

/* Host memory here is pageable (kiln and cudarc copy from and to Vecs; nothing is pinned), and
 * CUDA's rules for pageable memory apply ("API synchronization behavior" in the driver API's
 * documentation): a copy from the host returns once the source is staged, so the caller may
 * reuse it at once, and the device side is written in stream order; a copy to the host
 * returns only once the copy is done. */
EMU_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes,
                                         void *stream) {
  if (bytes && !kiln_emu_is_device(DEV(dst), bytes)) return CUDA_ERROR_INVALID_VALUE;
  copy_args *c = calloc(1, sizeof *c);
  c->dst = DEV(dst);
  c->staged = malloc(bytes ? bytes : 1);
  memcpy(c->staged, src, bytes);
  c->src = c->staged;
  c->bytes = bytes;
  kiln_emu_enqueue(stream, run_copy, c);
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes,
                                         void *stream) {
  if (bytes && !kiln_emu_is_device(DEV(src), bytes)) return CUDA_ERROR_INVALID_VALUE;
  enqueue_copy(dst, DEV(src), bytes, stream);
  return cuStreamSynchronize(stream);
}

EMU_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes,
                                         void *stream) {
  if (bytes && (!kiln_emu_is_device(DEV(dst), bytes) || !kiln_emu_is_device(DEV(src), bytes)))
    return CUDA_ERROR_INVALID_VALUE;
  return enqueue_copy(DEV(dst), DEV(src), bytes, stream);
}

EMU_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes) {
  CUresult r = cuMemcpyHtoDAsync_v2(dst, src, bytes, NULL);
  return r ? r : cuStreamSynchronize(NULL);
}

EMU_EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes) {
  CUresult r = cuMemcpyDtoHAsync_v2(dst, src, bytes, NULL);
  return r ? r : cuStreamSynchronize(NULL);
}

EMU_EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n,
                                    void *stream) {
  if (n && !kiln_emu_is_device(DEV(dst), n)) return CUDA_ERROR_INVALID_VALUE;
  copy_args *c = calloc(1, sizeof *c);
  c->dst = DEV(dst);
  c->bytes = n;
  c->set = 1;
  c->value = value;
  kiln_emu_enqueue(stream, run_copy, c);
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n) {
  CUresult r = cuMemsetD8Async(dst, value, n, NULL);
  return r ? r : cuStreamSynchronize(NULL);
}

/* ---- stream-ordered allocation (memory pools) ---- */

/* Allocated at once (a pool hands out memory before the stream gets there, too); freed when
 * the stream reaches the free, so that a free never waits for the stream. */
EMU_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, void *stream) {
  (void)stream;
  return cuMemAlloc_v2(dptr, bytes);
}

static void run_free(void *arg) { cuMemFree_v2((CUdeviceptr)(uintptr_t)arg); }

EMU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, void *stream) {
  if (!dptr) return CUDA_SUCCESS;
  if (!kiln_emu_is_device(DEV(dptr), 1)) return CUDA_ERROR_INVALID_VALUE;
  kiln_emu_enqueue(stream, run_free, DEV(dptr));
  return CUDA_SUCCESS;
}

/* ---- events ---- */

typedef struct emu_event {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  unsigned long recorded, done;
} emu_event;

typedef struct event_args {
  emu_event *event;
  unsigned long generation;
} event_args;

EMU_EXPORT CUresult cuEventCreate(emu_event **event, unsigned int flags) {
  (void)flags;
  if (!event) return CUDA_ERROR_INVALID_VALUE;
  emu_event *e = calloc(1, sizeof *e);
  pthread_mutex_init(&e->mu, NULL);
  pthread_cond_init(&e->cv, NULL);
  *event = e;
  return CUDA_SUCCESS;
}

static void run_record(void *arg) {
  event_args *a = arg;
  pthread_mutex_lock(&a->event->mu);
  if (a->generation > a->event->done) a->event->done = a->generation;
  pthread_cond_broadcast(&a->event->cv);
  pthread_mutex_unlock(&a->event->mu);
  free(a);
}

EMU_EXPORT CUresult cuEventRecord(emu_event *event, void *stream) {
  if (!event) return CUDA_ERROR_INVALID_HANDLE;
  event_args *a = malloc(sizeof *a);
  a->event = event;
  pthread_mutex_lock(&event->mu);
  a->generation = ++event->recorded;
  pthread_mutex_unlock(&event->mu);
  kiln_emu_enqueue(stream, run_record, a);
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuEventRecordWithFlags(emu_event *event, void *stream, unsigned int flags) {
  (void)flags;
  return cuEventRecord(event, stream);
}

EMU_EXPORT CUresult cuEventQuery(emu_event *event) {
  if (!event) return CUDA_ERROR_INVALID_HANDLE;
  pthread_mutex_lock(&event->mu);
  int ready = event->done >= event->recorded;
  pthread_mutex_unlock(&event->mu);
  return ready ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

static void wait_generation(emu_event *e, unsigned long generation) {
  pthread_mutex_lock(&e->mu);
  while (e->done < generation) pthread_cond_wait(&e->cv, &e->mu);
  pthread_mutex_unlock(&e->mu);
}

EMU_EXPORT CUresult cuEventSynchronize(emu_event *event) {
  if (!event) return CUDA_ERROR_INVALID_HANDLE;
  pthread_mutex_lock(&event->mu);
  unsigned long g = event->recorded;
  pthread_mutex_unlock(&event->mu);
  wait_generation(event, g);
  return CUDA_SUCCESS;
}

static void run_wait(void *arg) {
  event_args *a = arg;
  wait_generation(a->event, a->generation);
  free(a);
}

EMU_EXPORT CUresult cuStreamWaitEvent(void *stream, emu_event *event, unsigned int flags) {
  (void)flags;
  if (!event) return CUDA_ERROR_INVALID_HANDLE;
  event_args *a = malloc(sizeof *a);
  a->event = event;
  pthread_mutex_lock(&event->mu);
  a->generation = event->recorded;
  pthread_mutex_unlock(&event->mu);
  kiln_emu_enqueue(stream, run_wait, a);
  return CUDA_SUCCESS;
}

/* Events are small and a stream may still record into one after it is destroyed (CUDA allows
 * destroying an event in use): they are not freed. */
EMU_EXPORT CUresult cuEventDestroy_v2(emu_event *event) {
  (void)event;
  return CUDA_SUCCESS;
}

/* ---- errors ---- */

static const char *error_name(CUresult r) {
  switch (r) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    default: return "CUDA_ERROR_UNKNOWN";
  }
}

EMU_EXPORT CUresult cuGetErrorName(CUresult r, const char **name) {
  if (!name) return CUDA_ERROR_INVALID_VALUE;
  *name = error_name(r);
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuGetErrorString(CUresult r, const char **text) {
  if (!text) return CUDA_ERROR_INVALID_VALUE;
  *text = error_name(r);
  return CUDA_SUCCESS;
}
