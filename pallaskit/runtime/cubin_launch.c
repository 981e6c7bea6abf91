/* pallaskit's launcher of compiled Triton kernels inside an XLA program: an
 * XLA FFI handler (C API) that takes the kernel's cubin, so no PTX is
 * assembled when XLA compiles or first runs the program.
 * [Note: cubin launches] in pallaskit/runtime/ffi_targets.py says why; the
 * Python side builds this file with the C compiler Triton itself uses and
 * registers the handler as "pallaskit_cubin_launch".
 *
 * The call's "opaque" attribute (packed by runtime/triton_call.py, little
 * endian) is a header, the scalar parameters, the kernel's name and its cubin:
 *
 *   char magic[4] = "PKC1"; uint64 key;  (a hash of name, shared and cubin)
 *   uint32 grid[3], threads, shared, n_buffers, n_scalars, name_len, cubin_len;
 *   n_scalars x { uint32 bytes (4 or 8), uint32 pad, int64 value }
 *   char name[name_len]; char cubin[cubin_len];
 *
 * Kernel parameters are Triton's: one pointer per buffer (the call's operands,
 * then its results), the scalars, then null global and profile scratch
 * pointers (the Python side refuses kernels that need scratch memory). A
 * module is loaded once per (key, CUDA context) and kept for the process.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "xla/ffi/api/c_api.h"

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream;

#define CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES 1
#define CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES 8
#define CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN 97
#define CU_FUNC_CACHE_PREFER_SHARED 1
#define CU_STREAM_CAPTURE_STATUS_ACTIVE 1
#define STATIC_SHARED_LIMIT 49152

static struct {
  CUresult (*ModuleLoadData)(CUmodule *, const void *);
  CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
  CUresult (*FuncGetAttribute)(int *, int, CUfunction);
  CUresult (*FuncSetAttribute)(CUfunction, int, int);
  CUresult (*FuncSetCacheConfig)(CUfunction, int);
  CUresult (*CtxGetCurrent)(CUcontext *);
  CUresult (*CtxPushCurrent)(CUcontext);
  CUresult (*CtxPopCurrent)(CUcontext *);
  CUresult (*CtxGetDevice)(CUdevice *);
  CUresult (*StreamGetCtx)(CUstream, CUcontext *);
  CUresult (*StreamIsCapturing)(CUstream, int *);
  CUresult (*DeviceGetAttribute)(int *, int, CUdevice);
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           CUstream, void **, void **);
  CUresult (*GetErrorString)(CUresult, const char **);
} cu;

/* Loads libcuda's entry points; returns NULL or what is missing. Called once,
 * from Python, before the handler is registered. */
const char *pallaskit_cubin_launch_init(void) {
  static char missing[256];
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (lib == NULL) return "libcuda.so.1";
#define LOAD(field, symbol)                                 \
  *(void **)(&cu.field) = dlsym(lib, symbol);               \
  if (cu.field == NULL) {                                   \
    snprintf(missing, sizeof missing, "%s", symbol);        \
    return missing;                                         \
  }
  LOAD(ModuleLoadData, "cuModuleLoadData");
  LOAD(ModuleGetFunction, "cuModuleGetFunction");
  LOAD(FuncGetAttribute, "cuFuncGetAttribute");
  LOAD(FuncSetAttribute, "cuFuncSetAttribute");
  LOAD(FuncSetCacheConfig, "cuFuncSetCacheConfig");
  LOAD(CtxGetCurrent, "cuCtxGetCurrent");
  LOAD(CtxPushCurrent, "cuCtxPushCurrent_v2");
  LOAD(CtxPopCurrent, "cuCtxPopCurrent_v2");
  LOAD(CtxGetDevice, "cuCtxGetDevice");
  LOAD(StreamGetCtx, "cuStreamGetCtx");
  LOAD(StreamIsCapturing, "cuStreamIsCapturing");
  LOAD(DeviceGetAttribute, "cuDeviceGetAttribute");
  LOAD(LaunchKernel, "cuLaunchKernel");
  LOAD(GetErrorString, "cuGetErrorString");
#undef LOAD
  return NULL;
}

typedef struct {
  char magic[4];
  uint32_t key_lo, key_hi; /* uint64 key, unaligned-safe */
  uint32_t grid[3], threads, shared, n_buffers, n_scalars, name_len, cubin_len;
} Header;

typedef struct {
  uint32_t bytes, pad;
  int64_t value;
} Scalar;

/* Loaded functions, by (key, context): a chained table that only grows. */
typedef struct Loaded {
  uint64_t key;
  CUcontext context;
  CUfunction function;
  struct Loaded *next;
} Loaded;

#define BUCKETS 4096
static Loaded *table[BUCKETS];
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;

static XLA_FFI_Error *error(const XLA_FFI_Api *api, XLA_FFI_Error_Code code, const char *message) {
  XLA_FFI_Error_Create_Args args;
  memset(&args, 0, sizeof args);
  args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  args.message = message;
  args.errc = code;
  return api->XLA_FFI_Error_Create(&args);
}

static XLA_FFI_Error *cuda_error(const XLA_FFI_Api *api, const char *what, CUresult rc, const char *name) {
  char message[512];
  const char *text = NULL;
  if (cu.GetErrorString(rc, &text) != 0 || text == NULL) text = "unknown error";
  snprintf(message, sizeof message, "pallaskit_cubin_launch: %s failed for kernel %s: %s (CUresult %d)", what,
           name, text, rc);
  return error(api, XLA_FFI_Error_Code_INTERNAL, message);
}

static Loaded *find(uint64_t key, CUcontext context) {
  for (Loaded *l = __atomic_load_n(&table[key % BUCKETS], __ATOMIC_ACQUIRE); l != NULL; l = l->next)
    if (l->key == key && l->context == context) return l;
  return NULL;
}

/* The kernel's function in `context`, loading its module on first use. */
static XLA_FFI_Error *function_of(const XLA_FFI_Api *api, uint64_t key, CUcontext context, const char *name,
                                  const char *cubin, uint32_t shared, CUfunction *out) {
  Loaded *l = find(key, context);
  if (l != NULL) {
    *out = l->function;
    return NULL;
  }
  pthread_mutex_lock(&table_lock);
  XLA_FFI_Error *err = NULL;
  l = find(key, context);
  if (l == NULL) {
    CUresult rc;
    CUmodule module;
    CUfunction function;
    CUcontext popped;
    if ((rc = cu.CtxPushCurrent(context)) != 0) {
      err = cuda_error(api, "cuCtxPushCurrent", rc, name);
      goto done;
    }
    if ((rc = cu.ModuleLoadData(&module, cubin)) != 0) {
      err = cuda_error(api, "cuModuleLoadData", rc, name);
    } else if ((rc = cu.ModuleGetFunction(&function, module, name)) != 0) {
      err = cuda_error(api, "cuModuleGetFunction", rc, name);
    } else if (shared > STATIC_SHARED_LIMIT) { /* above 48 KiB a kernel opts in, as Triton's launcher does */
      CUdevice device;
      int optin = 0, static_bytes = 0;
      if ((rc = cu.CtxGetDevice(&device)) != 0 ||
          (rc = cu.DeviceGetAttribute(&optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device)) != 0 ||
          (rc = cu.FuncSetCacheConfig(function, CU_FUNC_CACHE_PREFER_SHARED)) != 0 ||
          (rc = cu.FuncGetAttribute(&static_bytes, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function)) != 0 ||
          (rc = cu.FuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    optin - static_bytes)) != 0)
        err = cuda_error(api, "opting in to shared memory", rc, name);
    }
    cu.CtxPopCurrent(&popped);
    if (err == NULL) {
      l = (Loaded *)malloc(sizeof(Loaded));
      if (l == NULL) {
        err = error(api, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, "pallaskit_cubin_launch: out of host memory");
        goto done;
      }
      l->key = key;
      l->context = context;
      l->function = function;
      l->next = table[key % BUCKETS];
      __atomic_store_n(&table[key % BUCKETS], l, __ATOMIC_RELEASE); /* readers walk without the lock */
    }
  }
done:
  if (err == NULL) *out = l->function;
  pthread_mutex_unlock(&table_lock);
  return err;
}

static const XLA_FFI_ByteSpan *string_attr(const XLA_FFI_CallFrame *frame, const char *name) {
  size_t n = strlen(name);
  for (int64_t i = 0; i < frame->attrs.size; ++i) {
    const XLA_FFI_ByteSpan *attr_name = frame->attrs.names[i];
    if (frame->attrs.types[i] == XLA_FFI_AttrType_STRING && attr_name->len == n &&
        memcmp(attr_name->ptr, name, n) == 0)
      return (const XLA_FFI_ByteSpan *)frame->attrs.attrs[i];
  }
  return NULL;
}

#define MAX_PARAMS 1024

XLA_FFI_Error *pallaskit_cubin_launch(XLA_FFI_CallFrame *frame) {
  const XLA_FFI_Api *api = frame->api;
  if (frame->extension_start != NULL && frame->extension_start->type == XLA_FFI_Extension_Metadata) {
    XLA_FFI_Metadata *metadata = ((XLA_FFI_Metadata_Extension *)frame->extension_start)->metadata;
    metadata->api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
    metadata->api_version.extension_start = NULL;
    metadata->api_version.major_version = XLA_FFI_API_MAJOR;
    metadata->api_version.minor_version = XLA_FFI_API_MINOR;
    metadata->traits = XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE; /* one launch on the given stream */
    return NULL;
  }
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;

  const XLA_FFI_ByteSpan *opaque = string_attr(frame, "opaque");
  if (opaque == NULL || opaque->len < sizeof(Header) || memcmp(opaque->ptr, "PKC1", 4) != 0)
    return error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "pallaskit_cubin_launch: no kernel in attribute opaque");
  Header h;
  memcpy(&h, opaque->ptr, sizeof h);
  size_t need = sizeof h + (size_t)h.n_scalars * sizeof(Scalar) + h.name_len + 1 + h.cubin_len;
  int64_t n_buffers = frame->args.size + frame->rets.size;
  if (opaque->len < need || h.n_buffers != n_buffers || h.n_buffers + h.n_scalars + 2 > MAX_PARAMS)
    return error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                 "pallaskit_cubin_launch: the kernel's opaque data does not match the call");
  const char *scalars = opaque->ptr + sizeof h;
  const char *name = scalars + h.n_scalars * sizeof(Scalar); /* NUL-terminated by the packer */
  const char *cubin = name + h.name_len + 1;
  uint64_t key = ((uint64_t)h.key_hi << 32) | h.key_lo;

  XLA_FFI_Stream_Get_Args stream_args;
  memset(&stream_args, 0, sizeof stream_args);
  stream_args.struct_size = XLA_FFI_Stream_Get_Args_STRUCT_SIZE;
  stream_args.ctx = frame->ctx;
  XLA_FFI_Error *err = api->XLA_FFI_Stream_Get(&stream_args);
  if (err != NULL) return err;
  CUstream stream = (CUstream)stream_args.stream;

  /* Inside graph capture cuStreamGetCtx may fail; XLA's thread has the context current then (as jaxlib does). */
  int capturing = 0;
  CUcontext context = NULL;
  CUresult rc = cu.StreamIsCapturing(stream, &capturing);
  if (rc == 0) rc = capturing == CU_STREAM_CAPTURE_STATUS_ACTIVE ? cu.CtxGetCurrent(&context)
                                                                : cu.StreamGetCtx(stream, &context);
  if (rc != 0) return cuda_error(api, "finding the stream's context", rc, name);

  CUfunction function;
  if ((err = function_of(api, key, context, name, cubin, h.shared, &function)) != NULL) return err;
  if ((uint64_t)h.grid[0] * h.grid[1] * h.grid[2] == 0) return NULL;

  void *pointers[MAX_PARAMS];
  Scalar values[MAX_PARAMS];
  void *params[MAX_PARAMS];
  int n = 0;
  for (int64_t i = 0; i < frame->args.size; ++i, ++n) {
    pointers[n] = ((XLA_FFI_Buffer *)frame->args.args[i])->data;
    params[n] = &pointers[n];
  }
  for (int64_t i = 0; i < frame->rets.size; ++i, ++n) {
    pointers[n] = ((XLA_FFI_Buffer *)frame->rets.rets[i])->data;
    params[n] = &pointers[n];
  }
  for (uint32_t i = 0; i < h.n_scalars; ++i, ++n) {
    memcpy(&values[i], scalars + i * sizeof(Scalar), sizeof(Scalar)); /* little endian: the low bytes first */
    params[n] = &values[i].value;
  }
  void *global_scratch = NULL, *profile_scratch = NULL;
  params[n++] = &global_scratch;
  params[n++] = &profile_scratch;
  rc = cu.LaunchKernel(function, h.grid[0], h.grid[1], h.grid[2], h.threads, 1, 1, h.shared, stream, params, NULL);
  return rc == 0 ? NULL : cuda_error(api, "cuLaunchKernel", rc, name);
}
