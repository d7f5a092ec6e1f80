// An all-reduce (sum) among T processes of one host through shared memory: each rank copies
// its tensor into its own slot of one segment, raises a sequence number, waits for every
// other rank's, and then reads all T slots and adds them itself, in rank order 0..T-1, in
// float32, rounding once to the tensor's type (bfloat16 to nearest even, as c10 does).
// Every rank so gets the same bits, and the same as the gloo path of
// ember/distributed/allreduce.py, which all-gathers and adds in that order.
// Reference: torch, sum_in_rank_order there: acc = x_0.float(); acc += x_1; ...;
// acc.to(x.dtype), bit for bit (tests/distributed/test_allreduce.py).
//
// Segment (name from the caller, who unlinks it once every rank has it mapped):
//   [Header: 64 B][RankState of rank 0 .. T-1: 64 B each][slots]
//   slots: rank 0 buffer 0, rank 0 buffer 1, rank 1 buffer 0, ...   slot_bytes each
// A tensor larger than a slot goes as chunks, one sequence number each (1, 2, ... counted
// alike on every rank, since every rank makes the same calls); chunk s uses buffer s % 2, so
// a rank may write chunk s + 1 while the others still read chunk s. Before it overwrites its
// buffer (chunk s + 2) it waits until every rank has read chunk s (their `done`).
// A broadcast (rank 0's bytes to the others, a step's plan) takes the same sequence numbers
// and buffers: rank 0 writes its slot and marks the chunk sent and read; the others copy it
// out and mark it read, so rank 0 may go on at once and waits only before it reuses a
// buffer, as an all-reduce does.
// Waiting spins for spin_us, then sleeps on a futex of the awaited word, which its writer
// wakes when it has sleepers (`waiters`): a waiting rank leaves its core to the others (two
// ranks on a two-core machine) and still wakes within microseconds. It raises after
// timeout_s, or at once where the awaited rank failed, closed or exited, instead of hanging.
#include "shm_allreduce.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "vec.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__linux__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#include <linux/futex.h>
#include <sys/syscall.h>
#define EMBER_FUTEX 1  // a sequence number's low 32 bits are the futex word at its address
#endif

namespace ember {

namespace {

constexpr uint64_t kMagic = 0x656d6265722d6172ull;  // "ember-ar"
constexpr uint64_t kLive = 0, kClosed = 1, kFailed = 2;
constexpr int64_t kSleepSliceNs = 10000000;  // a sleeper wakes this often to check its peer
constexpr int64_t kReduceGrain = 1 << 16;    // elements per thread of a large reduction

struct Header {
  uint64_t magic;
  int64_t world_size, slot_bytes;
  char pad[40];
};

struct ChunkInfo {  // what a rank's buffer holds: a check that the ranks' calls agree
  uint64_t call_bytes;   // the whole tensor's bytes
  uint32_t chunk_bytes;  // this chunk's
  uint32_t dtype;        // at::ScalarType
};

}  // namespace

// One cache line per rank, written by that rank only, but for `waiters`.
struct alignas(64) ShmRankState {
  uint64_t ready;    // the last chunk this rank has put in its slot
  uint64_t done;     // the last chunk this rank has read every rank's slot of
  uint64_t state;    // kLive, kClosed, kFailed
  int32_t pid;
  uint32_t waiters;  // other ranks asleep on this rank's ready or done
  ChunkInfo chunk[2];
};
static_assert(sizeof(ShmRankState) == 64, "one cache line each");

namespace {

using RankState = ShmRankState;
static_assert(sizeof(Header) == 64, "one cache line");

inline uint64_t load_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store_release(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Sleep until *word's low 32 bits differ from `seen`, a wake, or ns pass.
void sleep_on(uint64_t* word, uint32_t seen, int64_t ns) {
#ifdef EMBER_FUTEX
  timespec limit{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &limit, nullptr, 0);
#else
  (void)word, (void)seen;
  std::this_thread::sleep_for(std::chrono::nanoseconds(std::min<int64_t>(ns, 50000)));
#endif
}

void wake_all(uint64_t* word) {
#ifdef EMBER_FUTEX
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr,
          0);
#else
  (void)word;
#endif
}

// *word = v for the other ranks, waking those asleep on it. The fence orders the store
// before the read of `waiters`, as a sleeper orders its increment before its last look at
// *word: one of the two sees the other's write, so no wake is lost.
void publish(RankState* me, uint64_t* word, uint64_t v) {
  store_release(word, v);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (__atomic_load_n(&me->waiters, __ATOMIC_RELAXED) != 0) wake_all(word);
}

// dst[0, bytes) = src[0, bytes) for the other ranks to read, dst 64-byte aligned. Streaming
// stores send the lines past this core's caches: a reader on another core then fetches them
// from the shared cache or memory instead of snooping each modified line out of this core,
// and this rank's next write needs no invalidation of the readers' copies (a 73 KB chunk
// between two cores of an EPYC VM: 4x faster). The fence orders them before the flag.
void copy_to_slot(char* dst, const char* src, int64_t bytes) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 64 <= bytes; i += 64) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i),
                        _mm512_loadu_si512(reinterpret_cast<const void*>(src + i)));
  }
#elif defined(__SSE2__)
  for (; i + 16 <= bytes; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
  }
#endif
  std::memcpy(dst + i, src + i, bytes - i);
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

size_t segment_size(int64_t world_size, int64_t slot_bytes) {
  return sizeof(Header) + world_size * (sizeof(RankState) + 2 * slot_bytes);
}

// out[i] = (sum over p in 0..ranks-1, in that order, of slots[p][i] as float32) as T; out
// may be one of the slots (each element is read before it is written)
template <int Ranks, typename T>  // one pass over every slot: a stream each for the prefetcher
void sum_in_rank_order(const T* const* slots, T* out, int64_t begin, int64_t end) {
  const T* s[Ranks];
  for (int p = 0; p < Ranks; ++p) s[p] = slots[p];
  for (int64_t i = begin; i < end; ++i) {
    float acc = load(s[0][i]);
    for (int p = 1; p < Ranks; ++p) acc += load(s[p][i]);
    out[i] = store<T>(acc);
  }
}

template <typename T>  // any number of ranks: partial sums of a block at a time
void sum_in_rank_order(const T* const* slots, int64_t ranks, T* out, int64_t begin,
                       int64_t end) {
  constexpr int64_t kBlock = 256;  // partial sums stay in L1
  float acc[kBlock];
  for (int64_t i0 = begin; i0 < end; i0 += kBlock) {
    const int64_t n = std::min(kBlock, end - i0);
    for (int64_t j = 0; j < n; ++j) acc[j] = load(slots[0][i0 + j]);
    for (int64_t p = 1; p < ranks; ++p) {
      const T* s = slots[p] + i0;
      for (int64_t j = 0; j < n; ++j) acc[j] += load(s[j]);
    }
    for (int64_t j = 0; j < n; ++j) out[i0 + j] = store<T>(acc[j]);
  }
}

template <typename T>
void sum_slots(const T* const* slots, int64_t ranks, T* out, int64_t begin, int64_t end) {
  switch (ranks) {
    case 1: return sum_in_rank_order<1>(slots, out, begin, end);
    case 2: return sum_in_rank_order<2>(slots, out, begin, end);
    case 3: return sum_in_rank_order<3>(slots, out, begin, end);
    case 4: return sum_in_rank_order<4>(slots, out, begin, end);
    case 8: return sum_in_rank_order<8>(slots, out, begin, end);
    default: return sum_in_rank_order(slots, ranks, out, begin, end);
  }
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The segment `name` of `bytes`, created (and its memory reserved) or opened and mapped;
// nullptr and `error` set where that fails.
char* map_segment(const std::string& name, size_t bytes, bool create, std::string& error) {
  const int fd = shm_open(name.c_str(), create ? O_CREAT | O_EXCL | O_RDWR : O_RDWR, 0600);
  if (fd < 0) {
    error = "shm_open(" + name + ") failed: " + std::strerror(errno) +
            "; the all-reduce needs a writable /dev/shm shared by the ranks (kind 'gloo' "
            "works without one)";
    return nullptr;
  }
  if (create) {
    // reserve the memory now: a segment that tmpfs cannot back kills the process (SIGBUS)
    // at its first touch, where this is an error that says what to do
    const int e = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (e != 0) {
      error = "cannot reserve " + std::to_string(bytes) + " bytes of shared memory (" +
              std::strerror(e) + "); give /dev/shm more room (docker: --shm-size), lower " +
              "slot_bytes, or use kind 'gloo'";
    }
  } else {
    struct stat st {};
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
      error = "the segment " + name + " has " + std::to_string(st.st_size) + " bytes, not " +
              std::to_string(bytes) + ": the ranks disagree on world_size or slot_bytes";
    }
  }
  void* p = MAP_FAILED;
  if (error.empty()) {
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) error = std::string("mmap of the segment failed: ") + std::strerror(errno);
  }
  ::close(fd);
  if (!error.empty() && create) shm_unlink(name.c_str());
  return error.empty() ? static_cast<char*>(p) : nullptr;
}

}  // namespace

struct ShmAllReduce::Chunk {
  int buffer;
  ChunkInfo info;
};

ShmAllReduce::ShmAllReduce(const std::string& name, int64_t rank, int64_t world_size,
                           int64_t slot_bytes, bool create)
    : rank_(rank), world_size_(world_size), slot_bytes_(slot_bytes) {
  TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "rank ", rank,
              " is outside a group of ", world_size);
  TORCH_CHECK(slot_bytes >= 64 && slot_bytes % 64 == 0 && slot_bytes <= (1ll << 31),
              "slot_bytes must be a multiple of 64 in [64, 2^31], not ", slot_bytes);
  bytes_ = segment_size(world_size, slot_bytes);
  std::string error;
  base_ = map_segment(name, bytes_, create, error);
  TORCH_CHECK(base_ != nullptr, error);
  auto* header = reinterpret_cast<Header*>(base_);
  if (create) {
    header->world_size = world_size;
    header->slot_bytes = slot_bytes;
    store_release(&header->magic, kMagic);
  } else if (load_acquire(&header->magic) != kMagic || header->world_size != world_size ||
             header->slot_bytes != slot_bytes) {
    munmap(base_, bytes_);
    base_ = nullptr;
    TORCH_CHECK(false, "the segment ", name, " is not this group's all-reduce (world_size ",
                world_size, ", slot_bytes ", slot_bytes, ")");
  }
  __atomic_store_n(&state(rank_)->pid, static_cast<int32_t>(getpid()), __ATOMIC_RELEASE);
  pid_checked_.assign(world_size, 0);
}

ShmAllReduce::~ShmAllReduce() { close(); }

RankState* ShmAllReduce::state(int64_t rank) const {
  return reinterpret_cast<RankState*>(base_ + sizeof(Header)) + rank;
}

char* ShmAllReduce::slot(int64_t rank, int buffer) const {
  return base_ + sizeof(Header) + world_size_ * sizeof(RankState) +
         (2 * rank + buffer) * slot_bytes_;
}

// This rank's state becomes `s` (closed, failed), and whoever sleeps on it wakes to see so.
void ShmAllReduce::leave(uint64_t s) {
  RankState* me = state(rank_);
  store_release(&me->state, s);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (__atomic_load_n(&me->waiters, __ATOMIC_RELAXED) != 0) {
    wake_all(&me->ready);
    wake_all(&me->done);
  }
}

void ShmAllReduce::close() {
  if (base_ == nullptr) return;
  if (failed_.empty()) leave(kClosed);
  munmap(base_, bytes_);
  base_ = nullptr;
}

void ShmAllReduce::unlink(const std::string& name) {
  TORCH_CHECK(shm_unlink(name.c_str()) == 0 || errno == ENOENT, "shm_unlink(", name,
              ") failed: ", std::strerror(errno));
}

void ShmAllReduce::fail(const std::string& message) {
  failed_ = message;
  if (base_ != nullptr) leave(kFailed);  // the others' waits on this rank end now
  TORCH_CHECK(false, message);
}

// Whether `pid` has exited: gone, or a zombie its parent has not reaped yet (a rank's
// driver is often that parent, and it reaps only after this wait returns).
static bool process_exited(int32_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* file = std::fopen(path, "r");
  if (file == nullptr) return false;  // no /proc: only the kill test above
  char line[512];
  const size_t got = std::fread(line, 1, sizeof(line) - 1, file);
  std::fclose(file);
  line[got] = '\0';
  const char* close = std::strrchr(line, ')');  // the name may hold spaces and parentheses
  return close != nullptr && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

void ShmAllReduce::check_peers_alive() {
  for (int64_t p = 0; p < world_size_; ++p) {
    if (!pid_checked_[p]) continue;
    const int32_t pid = __atomic_load_n(&state(p)->pid, __ATOMIC_ACQUIRE);
    if (process_exited(pid)) {
      fail("all-reduce: rank " + std::to_string(p) + " (pid " + std::to_string(pid) +
           ") has exited while rank " + std::to_string(rank_) +
           " waits for it; restart the whole group");
    }
  }
}

// Returns once rank `peer`'s *word (its ready or done) reaches `target`; raises after
// timeout_s_, or where `peer` failed, closed or exited first. `what` names the wait.
void ShmAllReduce::wait_for(int64_t peer, uint64_t* word, uint64_t target, const char* what) {
  if (load_acquire(word) >= target) return;
  const auto start = std::chrono::steady_clock::now();
  RankState* theirs = state(peer);
  double last_pid_check = 0;
  bool spinning = true;
  for (uint64_t polls = 1;; ++polls) {
    const uint64_t seen = load_acquire(word);
    if (seen >= target) return;
    if (spinning && polls % 64 != 0) {  // the clock is read every 64 polls while spinning
      cpu_relax();
      continue;
    }
    const double waited = seconds_since(start);
    spinning = waited * 1e6 < spin_us_;
    if (!spinning) {
      __atomic_fetch_add(&theirs->waiters, 1, __ATOMIC_SEQ_CST);
      if (load_acquire(word) < target) {
        sleep_on(word, static_cast<uint32_t>(seen), kSleepSliceNs);
      }
      __atomic_fetch_sub(&theirs->waiters, 1, __ATOMIC_RELAXED);
      if (load_acquire(word) >= target) return;
    }
    const uint64_t peer_state = load_acquire(&theirs->state);
    if (peer_state != kLive && load_acquire(word) < target) {  // it may have sent, then left
      fail("all-reduce: rank " + std::to_string(peer) +
           (peer_state == kFailed ? " failed in its all-reduce" : " closed its all-reduce") +
           " while rank " + std::to_string(rank_) + " waits for it to " + what + " chunk " +
           std::to_string(target) + "; every rank must make the same calls");
    }
    if (waited > timeout_s_) {
      char waited_s[32];
      std::snprintf(waited_s, sizeof(waited_s), "%.1f", waited);
      fail("all-reduce: rank " + std::to_string(rank_) + " waited " + waited_s +
           " s for rank " + std::to_string(peer) + " to " + what + " chunk " +
           std::to_string(target) +
           "; it has stopped, hangs, or made other calls (every rank must all-reduce the "
           "same tensors in the same order); raise timeout_s if a rank may lag this long");
    }
    if (waited - last_pid_check > kSleepSliceNs * 1e-9) {
      check_peers_alive();
      last_pid_check = waited;
    }
  }
}

// out[0, elements) = the sum of every rank's chunk in `buffer`, this rank's read from `out`
// itself (it holds the same values, in this core's cache; its slot's went past it)
void ShmAllReduce::reduce(int buffer, void* out, int64_t elements, bool bf16) {
  std::vector<const void*> slots(world_size_);
  for (int64_t p = 0; p < world_size_; ++p) slots[p] = p == rank_ ? out : slot(p, buffer);
  at::parallel_for(0, elements, kReduceGrain, [&](int64_t begin, int64_t end) {
    if (bf16) {
      sum_slots(reinterpret_cast<const c10::BFloat16* const*>(slots.data()), world_size_,
                static_cast<c10::BFloat16*>(out), begin, end);
    } else {
      sum_slots(reinterpret_cast<const float* const*>(slots.data()), world_size_,
                static_cast<float*>(out), begin, end);
    }
  });
}

// Every other rank's chunk `seq` (buffer `chunk.buffer`) is in its slot, and is the same
// part of the same call as this rank's.
void ShmAllReduce::await_chunks(uint64_t seq, const Chunk& chunk) {
  for (int64_t p = 0; p < world_size_; ++p) {
    if (p == rank_) continue;
    wait_for(p, &state(p)->ready, seq, "send");
    const ChunkInfo theirs = state(p)->chunk[chunk.buffer];
    if (std::memcmp(&theirs, &chunk.info, sizeof(ChunkInfo)) != 0) {
      fail("all-reduce: rank " + std::to_string(p) + " sent " +
           std::to_string(theirs.call_bytes) + " bytes of " +
           c10::toString(static_cast<at::ScalarType>(theirs.dtype)) + " where rank " +
           std::to_string(rank_) + " sent " + std::to_string(chunk.info.call_bytes) +
           " bytes of " + c10::toString(static_cast<at::ScalarType>(chunk.info.dtype)) +
           "; every rank must all-reduce the same shapes and dtypes in the same order");
    }
  }
}

// Before any wait of a call: the call's limits, and the peers to watch.
void ShmAllReduce::begin_call(double timeout_s, double spin_us) {
  TORCH_CHECK(failed_.empty(), "this all-reduce failed before and cannot be used again: ",
              failed_);
  TORCH_CHECK(base_ != nullptr, "this all-reduce is closed");
  timeout_s_ = timeout_s;
  spin_us_ = spin_us;
  if (!watching_) watch_peers();
}

// Watch the pids of the peers that this process can see. Every rank has written its pid
// by now: the ranks open the segment together (allreduce.py open_shm) before any call.
void ShmAllReduce::watch_peers() {
  for (int64_t p = 0; p < world_size_; ++p) {
    const int32_t pid = __atomic_load_n(&state(p)->pid, __ATOMIC_ACQUIRE);
    pid_checked_[p] = p != rank_ && pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
  }
  watching_ = true;
}

// Every other rank has read chunk seq - 2, the last one in the buffer chunk seq takes.
void ShmAllReduce::await_buffer(uint64_t seq) {
  for (int64_t p = 0; seq > 2 && p < world_size_; ++p) {
    if (p != rank_) wait_for(p, &state(p)->done, seq - 2, "read");
  }
}

void ShmAllReduce::all_reduce(at::Tensor& x, double timeout_s, double spin_us) {
  begin_call(timeout_s, spin_us);
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "all_reduce takes a contiguous float32 or bfloat16 tensor on the CPU");
  const int64_t size = x.element_size(), numel = x.numel(), per_chunk = slot_bytes_ / size;
  RankState* me = state(rank_);
  char* data = static_cast<char*>(x.data_ptr());
  for (int64_t first = 0; first < numel; first += per_chunk) {
    const int64_t n = std::min(per_chunk, numel - first);
    const uint64_t seq = ++seq_;
    const Chunk chunk{static_cast<int>(seq % 2),
                      {static_cast<uint64_t>(numel * size), static_cast<uint32_t>(n * size),
                       static_cast<uint32_t>(x.scalar_type())}};
    await_buffer(seq);
    copy_to_slot(slot(rank_, chunk.buffer), data + first * size, n * size);
    me->chunk[chunk.buffer] = chunk.info;
    publish(me, &me->ready, seq);
    await_chunks(seq, chunk);
    reduce(chunk.buffer, data + first * size, n, x.scalar_type() == at::kBFloat16);
    publish(me, &me->done, seq);
  }
}

// Rank 0 fills its slot chunk by chunk and marks each sent and read (by itself); another
// rank takes each chunk from rank 0's slot and marks it read. A chunk's info says the
// whole call's bytes, so a receiver learns how many chunks follow from the first.
at::Tensor ShmAllReduce::broadcast(const at::Tensor& data, double timeout_s, double spin_us) {
  begin_call(timeout_s, spin_us);
  RankState* me = state(rank_);
  if (rank_ == 0) {
    TORCH_CHECK(data.device().is_cpu() && data.is_contiguous() &&
                    data.scalar_type() == at::kByte && data.dim() == 1,
                "broadcast sends a contiguous 1-d uint8 tensor on the CPU");
    const int64_t total = data.numel();
    const char* bytes = static_cast<const char*>(data.data_ptr());
    int64_t first = 0;
    do {
      const int64_t n = std::min(slot_bytes_, total - first);
      const uint64_t seq = ++seq_;
      const int buffer = static_cast<int>(seq % 2);
      await_buffer(seq);
      copy_to_slot(slot(rank_, buffer), bytes + first, n);
      me->chunk[buffer] = {static_cast<uint64_t>(total), static_cast<uint32_t>(n),
                           static_cast<uint32_t>(at::kByte)};
      publish(me, &me->ready, seq);
      publish(me, &me->done, seq);
      first += n;
    } while (first < total);
    return data;
  }
  at::Tensor out;
  int64_t total = -1, got = 0;
  do {
    const uint64_t seq = ++seq_;
    const int buffer = static_cast<int>(seq % 2);
    wait_for(0, &state(0)->ready, seq, "send");
    const ChunkInfo info = state(0)->chunk[buffer];
    if (info.dtype != static_cast<uint32_t>(at::kByte) ||
        (total >= 0 && info.call_bytes != static_cast<uint64_t>(total)) ||
        info.chunk_bytes > std::min<uint64_t>(info.call_bytes - got, slot_bytes_)) {
      fail("broadcast: rank 0 sent " + std::to_string(info.call_bytes) + " bytes of " +
           c10::toString(static_cast<at::ScalarType>(info.dtype)) + " where rank " +
           std::to_string(rank_) + " receives a broadcast; every rank must make the same " +
           "calls in the same order");
    }
    if (total < 0) {
      total = static_cast<int64_t>(info.call_bytes);
      out = at::empty({total}, at::TensorOptions().dtype(at::kByte));
    }
    std::memcpy(static_cast<char*>(out.data_ptr()) + got, slot(0, buffer), info.chunk_bytes);
    got += info.chunk_bytes;
    publish(me, &me->done, seq);
  } while (got < total);
  return out;
}

// Every chunk of rows: another rank puts its rows in its slot and marks them sent and read
// (it reads nothing); rank 0 copies its own rows and then each rank's, in rank order, into
// their columns of `out` and marks the chunk read.
void ShmAllReduce::gather(const at::Tensor& local, at::Tensor& out, int64_t widest,
                          double timeout_s, double spin_us) {
  begin_call(timeout_s, spin_us);
  TORCH_CHECK(local.device().is_cpu() && local.is_contiguous() && local.dim() == 2,
              "gather takes a contiguous 2-d tensor on the CPU");
  const int64_t rows = local.size(0), width = local.size(1), size = local.element_size();
  TORCH_CHECK(width <= widest && widest > 0 && widest * size <= slot_bytes_,
              "gather: ", width, " columns, widest ", widest, ": a row of the widest must fit ",
              "a slot of ", slot_bytes_, " bytes");
  const int64_t total = rank_ == 0 ? out.size(1) : 0;
  if (rank_ == 0) {
    TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.dim() == 2 &&
                    out.size(0) == rows && out.scalar_type() == local.scalar_type(),
                "gather: out must be a contiguous [", rows, ", sum of widths] tensor of ",
                local.scalar_type());
  }
  const int64_t per_chunk = slot_bytes_ / (widest * size);
  RankState* me = state(rank_);
  const char* mine = static_cast<const char*>(local.data_ptr());
  int64_t first = 0;
  do {  // one chunk at least, so that every rank makes as many calls with 0 rows
    const int64_t n = std::min(per_chunk, rows - first);
    const uint64_t seq = ++seq_;
    const int buffer = static_cast<int>(seq % 2);
    await_buffer(seq);
    const ChunkInfo info{static_cast<uint64_t>(rows * width * size),
                         static_cast<uint32_t>(n * width * size),
                         static_cast<uint32_t>(local.scalar_type())};
    if (rank_ != 0) {
      copy_to_slot(slot(rank_, buffer), mine + first * width * size, n * width * size);
      me->chunk[buffer] = info;
      publish(me, &me->ready, seq);
      publish(me, &me->done, seq);
    } else {
      char* dst = static_cast<char*>(out.data_ptr()) + first * total * size;
      int64_t column = 0;
      for (int64_t p = 0; p < world_size_; ++p) {
        const char* src = mine + first * width * size;
        int64_t w = width;
        if (p != 0) {
          wait_for(p, &state(p)->ready, seq, "send");
          const ChunkInfo theirs = state(p)->chunk[buffer];
          w = n == 0 ? 0 : theirs.chunk_bytes / (n * size);
          if (theirs.dtype != info.dtype || (n > 0 && theirs.chunk_bytes != w * n * size) ||
              column + w > total) {
            fail("gather: rank " + std::to_string(p) + " sent " +
                 std::to_string(theirs.chunk_bytes) + " bytes of " +
                 c10::toString(static_cast<at::ScalarType>(theirs.dtype)) + " for " +
                 std::to_string(n) + " rows of " + std::to_string(total - column) +
                 " columns left; every rank must gather the same rows and dtype, and their "
                 "widths add up to out's");
          }
          src = slot(p, buffer);
        }
        for (int64_t r = 0; r < n; ++r) {
          std::memcpy(dst + (r * total + column) * size, src + r * w * size, w * size);
        }
        column += w;
      }
      if (rows > 0 && column != total) {
        fail("gather: the ranks sent " + std::to_string(column) + " columns where out has " +
             std::to_string(total));
      }
      publish(me, &me->done, seq);
    }
    first += n;
  } while (first < rows);
}

}  // namespace ember
