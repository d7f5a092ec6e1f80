// The shared-memory all-reduce's interface (shm_allreduce.cpp), bound by bindings.cpp as
// ShmAllReduce. Layout and reference: as shm_allreduce.cpp states.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace ember {

struct ShmRankState;  // one rank's flags in the segment (shm_allreduce.cpp)

// One rank's end of an all-reduce among the processes of one host, over one POSIX
// shared-memory segment per group. Rank 0 creates the segment (`create`), the others open
// it once it exists; ShmAllReduce::unlink removes its name once every rank has it mapped,
// so that no segment outlives its processes, however they end.
class ShmAllReduce {
 public:
  ShmAllReduce(const std::string& name, int64_t rank, int64_t world_size, int64_t slot_bytes,
               bool create);
  ~ShmAllReduce();
  ShmAllReduce(const ShmAllReduce&) = delete;
  ShmAllReduce& operator=(const ShmAllReduce&) = delete;

  // x (float32 or bfloat16, contiguous, on the CPU) becomes, in place, the sum over the
  // ranks of their x, added in rank order 0..T-1 in float32 and rounded to x's type once.
  // Waits for the others at most timeout_s each time (spinning spin_us first, then asleep,
  // off the core); raises, and makes every later call (and the others' waits on this rank)
  // raise, where a rank does not come, has exited or sent another size or type.
  void all_reduce(at::Tensor& x, double timeout_s, double spin_us);

  // Rank 0's bytes to every rank, through the same slots and sequence numbers (every rank
  // makes its broadcasts and all-reduces in one order): rank 0 passes `data` (uint8,
  // contiguous, on the CPU) and gets it back; the others pass an empty tensor and get a new
  // one of rank 0's bytes, however many (more than a slot go as chunks). Rank 0 does not
  // wait for the others to read, but, as all_reduce, for them to have read the buffer it
  // overwrites. Waits, raises and fails as all_reduce; timeout_s may be infinite (a worker
  // waiting for its next step), and a peer that exits or closes still ends the wait.
  at::Tensor broadcast(const at::Tensor& data, double timeout_s, double spin_us);

  // Every rank's `local` [N, w_rank] (contiguous, on the CPU; every rank the same N and
  // dtype) side by side into rank 0's `out` [N, sum of w] (contiguous, that dtype), at the
  // columns of the ranks before; the others pass an empty `out`. `widest`: the largest
  // w_rank, the same on every rank (rows go in chunks of slot_bytes / (widest * element
  // size), one row at least). The others do not wait for rank 0 to read, but, as
  // all_reduce, before they overwrite a buffer. Waits, raises and fails as all_reduce.
  void gather(const at::Tensor& local, at::Tensor& out, int64_t widest, double timeout_s,
              double spin_us);

  // This rank leaves the group: the others' waits on it raise at once, instead of at their
  // timeout. The destructor closes too.
  void close();

  static void unlink(const std::string& name);
  int64_t segment_bytes() const { return static_cast<int64_t>(bytes_); }

 private:
  struct Chunk;
  ShmRankState* state(int64_t rank) const;
  char* slot(int64_t rank, int buffer) const;
  void wait_for(int64_t peer, uint64_t* word, uint64_t target, const char* what);
  void await_chunks(uint64_t seq, const Chunk& chunk);
  void await_buffer(uint64_t seq);
  void begin_call(double timeout_s, double spin_us);
  void watch_peers();
  void reduce(int buffer, void* out, int64_t elements, bool bf16);
  void check_peers_alive();
  void leave(uint64_t state);
  [[noreturn]] void fail(const std::string& message);

  int64_t rank_, world_size_, slot_bytes_;
  size_t bytes_ = 0;
  char* base_ = nullptr;
  uint64_t seq_ = 0;            // chunks sent so far, the same count on every rank
  double timeout_s_ = 0, spin_us_ = 0;
  std::string failed_;          // why this end stopped working; empty while it works
  std::vector<int8_t> pid_checked_;  // per peer: its pid seen alive from here (same pid space)
  bool watching_ = false;            // pid_checked_ is filled in (at the first call)
};

}  // namespace ember
