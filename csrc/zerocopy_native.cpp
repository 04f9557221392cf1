// Native helpers for zerocopy_pickle (see csrc/README.md and zerocopy_pickle/native.py).
//
// Built at run time by torch.utils.cpp_extension (never at pip install time) and loaded only when the
// native backend is active. Every function here has a pure-Python twin giving the same results; native.py
// chooses between them.
//
//   storage_from_buffer(obj) -> torch.UntypedStorage
//       A CPU storage over a writable, C-contiguous buffer, without copying it. The storage owns a
//       Py_buffer export of `obj` for as long as it lives: an exporter such as mmap refuses close() while
//       any storage over it is alive, so memory is never unmapped under a tensor.
//   jit_load_from_buffer(obj, device) -> torch._C.ScriptModule
//       torch.jit.load's import, reading the archive in place from the buffer's memory: no bytes object,
//       no std::string and no std::istringstream copy of the archive.
//   analyze_stream(stream) -> (code, offset, payload)
//       streamcheck.check_stream + semantics.analyze in one pass (restricted loads' analysis of a pickle
//       stream); on any error the caller re-runs the Python checks for the exact exception and message.

// Only the headers these helpers use (not <torch/extension.h>, which pulls in the whole C++ frontend and
// doubles the compile time).
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/jit/api/compilation_unit.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <istream>
#include <memory>
#include <optional>
#include <streambuf>
#include <vector>

namespace py = pybind11;

namespace {

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// Owns one Py_buffer export; the DataPtr context of a storage built by storage_from_buffer.
struct BufferExport {
  Py_buffer view{};
};

// The storage's deleter. It may run on any thread, with or without the GIL (a tensor freed by a C++ worker
// thread, say), so it takes the GIL itself when it does not hold it. While the interpreter shuts down, only
// a thread that already holds the GIL may touch Python objects (taking the GIL then could hang another
// thread); elsewhere, and after shutdown, the export is leaked: the process is exiting.
void release_export(void* context) {
  auto* owner = static_cast<BufferExport*>(context);
  if (Py_IsInitialized()) {
    if (PyGILState_Check()) {
      PyBuffer_Release(&owner->view);
    } else if (!finalizing()) {
      PyGILState_STATE state = PyGILState_Ensure();
      PyBuffer_Release(&owner->view);
      PyGILState_Release(state);
    }
  }
  delete owner;
}

py::object wrap_storage(c10::Storage storage) {
  PyObject* result = THPStorage_Wrap(std::move(storage));
  if (result == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(result);
}

py::object storage_from_buffer(const py::handle& obj) {
  auto owner = std::make_unique<BufferExport>();
  if (PyObject_GetBuffer(obj.ptr(), &owner->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
    // BufferError for read-only or non-contiguous buffers, TypeError for objects without the protocol.
    throw py::error_already_set();
  }
  const Py_ssize_t nbytes = owner->view.len;
  if (nbytes == 0) {
    // Nothing to alias or protect: the same storage as torch.UntypedStorage(0).
    PyBuffer_Release(&owner->view);
    return wrap_storage(c10::Storage(c10::make_intrusive<c10::StorageImpl>(
        c10::StorageImpl::use_byte_size_t(), 0, c10::GetCPUAllocator(), /*resizable=*/true)));
  }
  void* data = owner->view.buf;
  // From here the DataPtr owns the export: if anything below throws, its destructor releases it.
  c10::DataPtr data_ptr(data, owner.release(), &release_export, c10::Device(c10::DeviceType::CPU));
  auto impl = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), static_cast<int64_t>(nbytes), std::move(data_ptr),
      /*allocator=*/nullptr, /*resizable=*/false);
  return wrap_storage(c10::Storage(std::move(impl)));
}

// A read-only std::streambuf over memory the caller keeps alive; seekable, which is all the archive reader
// (caffe2::serialize::IStreamAdapter) needs.
class MemoryStreamBuf final : public std::streambuf {
 public:
  MemoryStreamBuf(const char* data, std::size_t size) {
    char* begin = const_cast<char*>(data);  // never written: this streambuf has no put area
    setg(begin, begin, begin + size);
  }

 protected:
  pos_type seekoff(off_type off, std::ios_base::seekdir dir, std::ios_base::openmode which) override {
    if (!(which & std::ios_base::in)) {
      return pos_type(off_type(-1));
    }
    off_type base = 0;
    if (dir == std::ios_base::cur) {
      base = gptr() - eback();
    } else if (dir == std::ios_base::end) {
      base = egptr() - eback();
    }
    return seekpos(pos_type(base + off), which);
  }

  pos_type seekpos(pos_type pos, std::ios_base::openmode which) override {
    const off_type offset = off_type(pos);
    if (!(which & std::ios_base::in) || offset < 0 || offset > egptr() - eback()) {
      return pos_type(off_type(-1));
    }
    setg(eback(), eback() + offset, egptr());
    return pos;
  }
};

struct BufferGuard {
  Py_buffer view{};
  bool held = false;
  ~BufferGuard() {
    if (held) {
      PyBuffer_Release(&view);
    }
  }
};

torch::jit::Module jit_load_from_buffer(const py::handle& obj, std::optional<c10::Device> device) {
  BufferGuard guard;
  if (PyObject_GetBuffer(obj.ptr(), &guard.view, PyBUF_C_CONTIGUOUS) != 0) {
    throw py::error_already_set();
  }
  guard.held = true;
  // The export is held for the whole import, so the buffer cannot be closed or resized meanwhile. The import
  // copies every record it keeps (tensor data included): nothing in the module points into the buffer.
  MemoryStreamBuf streambuf(static_cast<const char*>(guard.view.buf), static_cast<std::size_t>(guard.view.len));
  std::istream in(&streambuf);
  auto cu = std::make_shared<torch::jit::CompilationUnit>();
  torch::jit::ExtraFilesMap extra_files;
  return torch::jit::import_ir_module(
      std::move(cu), in, device, extra_files, /*load_debug_files=*/true, /*restore_shapes=*/false);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// analyze_stream: streamcheck.check_stream + semantics.analyze in one pass (see semantics.py, the reference)
// ---------------------------------------------------------------------------------------------------------
//
// Two models run side by side over the opcodes, exactly as the two Python passes do:
//   * the bounds walk of streamcheck.walk_stream: one stack depth counter, a list of MARK depths, the memo's
//     size, NEXT_BUFFER count (its stack model differs from the unpickler's: POP with an empty frame lowers
//     the depth but keeps the MARK, as walk_stream does);
//   * the tag analysis of semantics.analyze: a flat stack of tag indices split into frames by fences (the
//     metastack), the memo (dense, so a vector), tags shared by reference (memo, DUP) exactly like the
//     Python _Tag objects, whose `depth` and `built` fields mutate in place.
// A bounds violation anywhere decides (check_stream runs first in Python). An analysis error stops the
// analysis but not the walk, so a later bounds violation still wins, as it does in Python. The caller
// re-runs the Python checks on any nonzero code to get the exact message; kDefer marks what this code does
// not judge itself (text memo indices that are not plain decimal digits, huge streams, inconsistencies).
//
// Hostile input: every read is checked against `end` before it happens, lengths are compared with the bytes
// left (never added to a position first), containers grow by at most one entry per opcode, nothing recurses.

namespace {  // internal linkage, as pybind11's own types have hidden visibility
namespace semantics_native {

constexpr std::size_t kMaxStack = std::size_t(1) << 20;  // streamcheck.MAX_STACK
constexpr std::size_t kMaxMarks = 50000;                  // streamcheck.MAX_MARKS
constexpr uint32_t kMaxDepth = 5000;                      // tags.MAX_DEPTH
constexpr uint32_t kMaxUnprotectedDepth = 200;            // tags.MAX_UNPROTECTED_DEPTH
constexpr uint32_t kMaxKeyDepth = 100;                    // tags.MAX_KEY_DEPTH
constexpr std::size_t kMaxNameLength = 1024;              // tags.MAX_NAME_LENGTH
constexpr uint64_t kHashFloor = uint64_t(1) << 20;        // tags.HASH_FLOOR
constexpr uint64_t kHashPerByte = 4;                      // tags.HASH_PER_BYTE
constexpr uint64_t kSizeCap = (uint64_t(1) << 40) - 1;    // tags._SIZE_CAP (above every budget)
constexpr uint64_t kCollisionFloor = uint64_t(1) << 25;   // tags.COLLISION_FLOOR
enum HashKind : uint8_t { kSecret = 0, kKnown = 1, kChosen = 2 };  // tags._SECRET, _KNOWN, _CHOSEN
// tags._HASHK: a tuple's or frozenset's hash kind from the bit set of its items' (1 << kind).
constexpr uint8_t kHashOfItems[8] = {kKnown, kSecret, kChosen, kSecret, kChosen, kChosen, kChosen, kChosen};
// tags._FROZEN_HASHK: a frozenset XORs its members' hashes, so a common secret member cancels out.
constexpr uint8_t kFrozenHashOfItems[8] = {kKnown, kSecret, kChosen, kChosen, kChosen, kChosen, kChosen, kChosen};

enum Code : int { kOk = 0, kMalformed = 1, kRefused = 2, kTooDeep = 3, kDefer = 4 };
enum Kind : uint8_t { kPrim, kStr, kBytes, kTuple, kList, kDict, kSet, kFrozenset, kGlobal, kResult, kBuffer };
enum ArgKind : uint8_t { kUnknown, kPlain, kArg1, kArg2, kArg4, kArg8, kLen1, kLen4, kLen8, kLine, kLine2 };
constexpr int8_t kToMarkPush = -1, kToMark = -2, kMarkOp = -3;
enum MutBit : uint8_t { kBuildBit = 1, kSetitemBit = 2, kAppendBit = 4, kAddBit = 8 };
constexpr uint32_t kNone = 0xFFFFFFFFu;

struct OpInfo {
  uint8_t arg = kUnknown;
  int8_t pops = 0;
  uint8_t pushes = 0;
};

struct OpTable {
  OpInfo ops[256];
  constexpr void set(unsigned char op, uint8_t arg, int8_t pops, uint8_t pushes) {
    ops[op].arg = arg;
    ops[op].pops = pops;
    ops[op].pushes = pushes;
  }
  constexpr OpTable() {  // streamcheck._TABLE
    set('(', kPlain, kMarkOp, 0);
    set('.', kPlain, 1, 0);
    set('0', kPlain, 1, 0);
    set('1', kPlain, kToMark, 0);
    set('2', kPlain, 1, 2);
    set('N', kPlain, 0, 1);
    set('a', kPlain, 2, 1);
    set('b', kPlain, 2, 1);
    set('d', kPlain, kToMarkPush, 1);
    set('}', kPlain, 0, 1);
    set('e', kPlain, kToMark, 0);
    set('l', kPlain, kToMarkPush, 1);
    set(']', kPlain, 0, 1);
    set('o', kPlain, kToMarkPush, 1);
    set('R', kPlain, 2, 1);
    set('s', kPlain, 3, 1);
    set('t', kPlain, kToMarkPush, 1);
    set(')', kPlain, 0, 1);
    set('u', kPlain, kToMark, 0);
    set('Q', kPlain, 1, 1);
    set(0x81, kPlain, 2, 1);
    set(0x85, kPlain, 1, 1);
    set(0x86, kPlain, 2, 1);
    set(0x87, kPlain, 3, 1);
    set(0x88, kPlain, 0, 1);
    set(0x89, kPlain, 0, 1);
    set(0x8f, kPlain, 0, 1);
    set(0x90, kPlain, kToMark, 0);
    set(0x91, kPlain, kToMarkPush, 1);
    set(0x92, kPlain, 3, 1);
    set(0x93, kPlain, 2, 1);
    set(0x94, kPlain, 1, 1);
    set(0x97, kPlain, 0, 1);
    set(0x98, kPlain, 1, 1);
    set('J', kArg4, 0, 1);
    set('K', kArg1, 0, 1);
    set('M', kArg2, 0, 1);
    set('h', kArg1, 0, 1);
    set('j', kArg4, 0, 1);
    set('q', kArg1, 1, 1);
    set('r', kArg4, 1, 1);
    set('G', kArg8, 0, 1);
    set(0x80, kArg1, 0, 0);
    set(0x82, kArg1, 0, 1);
    set(0x83, kArg2, 0, 1);
    set(0x84, kArg4, 0, 1);
    set(0x95, kArg8, 0, 0);
    set('U', kLen1, 0, 1);
    set('T', kLen4, 0, 1);
    set('C', kLen1, 0, 1);
    set('B', kLen4, 0, 1);
    set(0x8e, kLen8, 0, 1);
    set(0x8c, kLen1, 0, 1);
    set('X', kLen4, 0, 1);
    set(0x8d, kLen8, 0, 1);
    set(0x96, kLen8, 0, 1);
    set(0x8a, kLen1, 0, 1);
    set(0x8b, kLen4, 0, 1);
    set('I', kLine, 0, 1);
    set('L', kLine, 0, 1);
    set('F', kLine, 0, 1);
    set('S', kLine, 0, 1);
    set('V', kLine, 0, 1);
    set('P', kLine, 0, 1);
    set('g', kLine, 0, 1);
    set('p', kLine, 1, 1);
    set('c', kLine2, 0, 1);
    set('i', kLine2, kToMarkPush, 1);
  }
};

constexpr OpTable kTable{};

struct Tag {
  uint8_t kind;
  uint8_t built : 1;
  uint8_t nested : 1;  // put into another value (semantics' Note [The cost model])
  uint8_t hashk : 2;   // HashKind
  uint16_t depth;      // <= kMaxDepth + 1
  uint32_t ref;        // kGlobal/kResult: pair index; kStr: string index (kNone: text unknown)
  // Keys of chosen hash this dict or set (or object) received, saturating at kChosenCap: the collision budget
  // (at most 2**33 for the 2**31-byte streams this pass takes) refuses the 2**17-th such key already.
  uint64_t chosen : 24;
  uint64_t size : 40;  // expanded size, saturating at kSizeCap
};
static_assert(sizeof(Tag) == 16, "a tag per value the stream creates: keep it small");
constexpr uint64_t kChosenCap = (uint64_t(1) << 24) - 1;

inline uint64_t add_size(uint64_t a, uint64_t b) {  // both <= kSizeCap: no overflow
  return std::min(a + b, kSizeCap);
}

// Singleton tags (never mutated: only kResult and container tags are).
constexpr uint32_t kPrimTag = 0, kBytesTag = 1, kBufferTag = 2, kUnknownStrTag = 3, kChosenTag = 4;
constexpr uint32_t kSingletons = 5;

struct Text {
  std::size_t offset;
  std::size_t length;
  py::object decoded;  // null while the bytes are ASCII and nobody asked for the str
};

class Analyzer {
 public:
  Analyzer(const unsigned char* data, std::size_t end, std::size_t collect_at)
      : data_(data),
        end_(end),
        hash_left_(std::max<uint64_t>(kHashFloor, kHashPerByte * static_cast<uint64_t>(end))),
        colliding_left_(std::max<uint64_t>(kCollisionFloor, kHashPerByte * static_cast<uint64_t>(end))),
        collect_at_(std::max<std::size_t>(collect_at, 8)),
        next_collect_(collect_at_) {
    tags_.push_back({kPrim, 0, 0, kKnown, 0, kNone, 0, 1});
    tags_.push_back({kBytes, 0, 0, kSecret, 0, kNone, 0, 1});
    tags_.push_back({kBuffer, 0, 0, kSecret, 0, kNone, 0, 1});
    tags_.push_back({kStr, 0, 0, kSecret, 0, kNone, 0, 1});
    tags_.push_back({kPrim, 0, 0, kChosen, 0, kNone, 0, 1});
  }

  // Returns (code, offset, payload); payload is None unless code == kOk.
  py::tuple run() {
    if (end_ >= (std::size_t(1) << 31)) {
      return failure(kDefer, 0);
    }
    std::size_t pos = 0;
    while (pos < end_) {
      const std::size_t start = pos;
      const unsigned char op = data_[pos];
      const OpInfo info = kTable.ops[op];
      if (info.arg == kUnknown) {
        return failure(kMalformed, start);
      }
      pos += 1;
      uint64_t arg = 0;
      std::size_t text_offset = 0, text_length = 0;  // a string's bytes, or a line's (two lines for GLOBAL/INST)
      switch (info.arg) {
        case kPlain:
          break;
        case kArg1:
        case kArg2:
        case kArg4:
        case kArg8: {
          const std::size_t width = info.arg == kArg1 ? 1 : info.arg == kArg2 ? 2 : info.arg == kArg4 ? 4 : 8;
          if (width > end_ - pos) {
            return failure(kMalformed, start);
          }
          arg = read_le(pos, width);
          pos += width;
          break;
        }
        case kLen1:
        case kLen4:
        case kLen8: {
          const std::size_t width = info.arg == kLen1 ? 1 : info.arg == kLen4 ? 4 : 8;
          if (width > end_ - pos) {
            return failure(kMalformed, start);
          }
          uint64_t length = read_le(pos, width);
          pos += width;
          if ((op == 'T' || op == 0x8b) && (length & 0x80000000u)) {  // BINSTRING, LONG4: signed lengths
            return failure(kMalformed, start);
          }
          if (length > static_cast<uint64_t>(end_ - pos)) {
            return failure(kMalformed, start);
          }
          text_offset = pos;
          text_length = static_cast<std::size_t>(length);
          pos += text_length;
          break;
        }
        default: {  // kLine, kLine2
          text_offset = pos;
          for (int line = 0; line < (info.arg == kLine2 ? 2 : 1); ++line) {
            const void* newline = std::memchr(data_ + pos, '\n', end_ - pos);
            if (newline == nullptr) {
              return failure(kMalformed, start);
            }
            pos = static_cast<std::size_t>(static_cast<const unsigned char*>(newline) - data_) + 1;
          }
          text_length = pos - 1 - text_offset;
          if (op == 'p' || op == 'g') {
            // int(text) in Python also takes signs, spaces and underscores: those streams go to Python.
            if (text_length == 0 || text_length > 18) {
              return failure(kDefer, start);
            }
            for (std::size_t i = text_offset; i < text_offset + text_length; ++i) {
              const unsigned char c = data_[i];
              if (c < '0' || c > '9') {
                return failure(kDefer, start);
              }
              arg = arg * 10 + (c - '0');
            }
          }
          break;
        }
      }
      // The memo, frames and buffers (walk_stream's order).
      if (op == 'q' || op == 'r' || op == 'p') {
        if (arg > memo_size_) {
          return failure(kMalformed, start);
        }
        if (arg + 1 > memo_size_) {
          memo_size_ = arg + 1;
        }
      } else if (op == 'h' || op == 'j' || op == 'g') {
        if (arg >= memo_size_) {
          return failure(kMalformed, start);
        }
      } else if (op == 0x95) {
        if (arg > static_cast<uint64_t>(end_ - pos)) {
          return failure(kMalformed, start);
        }
      } else if (op == 0x94) {
        memo_size_ += 1;
      } else if (op == 0x97) {
        buffers_ += 1;
      }
      if (op == 'P' || op == 'Q') {
        return failure(kMalformed, start);
      }
      // Stack effect.
      if (info.pops >= 0) {
        if (depth_ < static_cast<std::size_t>(info.pops)) {
          return failure(kMalformed, start);
        }
        depth_ = depth_ - info.pops + info.pushes;
      } else if (info.pops == kMarkOp) {
        if (marks_.size() >= kMaxMarks) {
          return failure(kMalformed, start);
        }
        marks_.push_back(depth_);
      } else {
        if (marks_.empty()) {
          return failure(kMalformed, start);
        }
        depth_ = marks_.back();
        marks_.pop_back();
        if (info.pops == kToMarkPush) {
          depth_ += 1;
        } else if ((op == 'e' || op == 'u' || op == 0x90) && depth_ < 1) {
          return failure(kMalformed, start);
        }
      }
      if (depth_ > kMaxStack) {
        return failure(kMalformed, start);
      }
      if (op == '.') {
        if (pos != end_ || !marks_.empty()) {
          return failure(kMalformed, start);
        }
      }
      if (alive_) {
        if (tags_.size() >= next_collect_ || texts_.size() >= next_collect_) {
          collect();
        }
        analyze(op, start, arg, text_offset, text_length);
      }
      if (op == '.') {
        if (deferred_) {
          return failure(kDefer, error_pos_);
        }
        if (!alive_) {
          return failure(error_code_, error_pos_);
        }
        return success();
      }
    }
    return failure(kMalformed, end_);
  }

 private:
  const unsigned char* data_;
  std::size_t end_;
  // The bounds walk.
  std::size_t depth_ = 0;
  std::vector<std::size_t> marks_;
  uint64_t memo_size_ = 0;
  uint64_t buffers_ = 0;
  // The analysis.
  bool alive_ = true;
  bool deferred_ = false;
  uint64_t hash_left_;       // tags._Hashing.left
  uint64_t colliding_left_;  // tags._Hashing.colliding
  int error_code_ = kOk;
  std::size_t error_pos_ = 0;
  std::vector<Tag> tags_;
  std::vector<uint32_t> stack_;
  std::vector<std::size_t> fences_;  // where each open MARK's frame starts in stack_
  std::vector<uint32_t> memo_;
  std::vector<Text> texts_;
  py::dict pair_index_;
  std::vector<py::object> pairs_;  // (module, qualname) tuples, in order of first appearance
  std::vector<uint8_t> called_, instantiated_, mutated_;
  std::vector<uint8_t> unprotected_;  // the pair is in tags._UNPROTECTED
  std::vector<uint32_t> mutated_order_;
  std::size_t collect_at_;
  std::size_t next_collect_;

  // Drops the tags (and string texts) no stack slot or memo entry refers to any more. Python frees a popped
  // _Tag; without this a stream of "]0" (push a list, pop it) would make this pass hold 12 bytes per 2 bytes
  // of stream. Tags refer to no other tag, so compaction only renumbers the stack and the memo. It runs when
  // the tables double past what survived the last time: amortised O(1) per opcode, never for small streams.
  void collect() {
    std::vector<uint32_t> renumber(tags_.size(), kNone);
    std::vector<Tag> kept;
    kept.reserve(kSingletons + stack_.size() + memo_.size());
    for (uint32_t i = 0; i < kSingletons; ++i) {  // the singletons keep their numbers
      renumber[i] = i;
      kept.push_back(tags_[i]);
    }
    auto keep = [&](uint32_t& index) {
      if (renumber[index] == kNone) {
        renumber[index] = static_cast<uint32_t>(kept.size());
        kept.push_back(tags_[index]);
      }
      index = renumber[index];
    };
    for (uint32_t& index : stack_) {
      keep(index);
    }
    for (uint32_t& index : memo_) {
      keep(index);
    }
    tags_.swap(kept);
    std::vector<uint32_t> renumber_text(texts_.size(), kNone);
    std::vector<Text> kept_texts;
    for (Tag& tag : tags_) {
      if (tag.kind == kStr && tag.ref != kNone) {
        if (renumber_text[tag.ref] == kNone) {
          renumber_text[tag.ref] = static_cast<uint32_t>(kept_texts.size());
          kept_texts.push_back(std::move(texts_[tag.ref]));
        }
        tag.ref = renumber_text[tag.ref];
      }
    }
    texts_.swap(kept_texts);
    next_collect_ = std::max(collect_at_, 2 * std::max(tags_.size(), texts_.size()));
  }

  uint64_t read_le(std::size_t pos, std::size_t width) const {  // caller checked width <= end_ - pos
    uint64_t value = 0;
    for (std::size_t i = 0; i < width; ++i) {
      value |= static_cast<uint64_t>(data_[pos + i]) << (8 * i);
    }
    return value;
  }

  py::tuple failure(int code, std::size_t pos) const {
    return py::make_tuple(code, pos, py::none());
  }

  void die(int code, std::size_t pos) {
    alive_ = false;
    error_code_ = code;
    error_pos_ = pos;
  }

  void defer(std::size_t pos) {  // something this code does not judge: Python decides
    deferred_ = true;
    die(kDefer, pos);
  }

  std::size_t fence() const { return fences_.empty() ? 0 : fences_.back(); }
  std::size_t frame_size() const { return stack_.size() - fence(); }

  uint32_t new_tag(uint8_t kind, uint32_t ref, uint32_t depth, uint64_t size = 1, uint8_t hashk = kSecret) {
    tags_.push_back({kind, 0, 0, hashk, static_cast<uint16_t>(depth), ref, 0, size});
    return static_cast<uint32_t>(tags_.size() - 1);
  }

  // _container: depth and expanded size of a container of the tags stack_[from, to), which are now nested;
  // false (and dead) if too deep.
  bool container(std::size_t from, std::size_t to, std::size_t pos, uint32_t* depth_out, uint64_t* size_out,
                 uint8_t* hashk_out = nullptr) {
    uint32_t depth = 0;
    uint64_t size = 1;
    unsigned bits = 0;
    for (std::size_t i = from; i < to; ++i) {
      Tag& item = tags_[stack_[i]];
      item.nested = true;
      depth = std::max<uint32_t>(depth, item.depth);
      size = add_size(size, item.size);
      bits |= 1u << item.hashk;
    }
    if (depth >= kMaxDepth) {
      die(kTooDeep, pos);
      return false;
    }
    *depth_out = depth + 1;
    *size_out = size;
    if (hashk_out != nullptr) {
      *hashk_out = static_cast<uint8_t>(bits);  // the callers map it: kHashOfItems, kFrozenHashOfItems
    }
    return true;
  }

  // _result: a call's result tag; kNone (and dead) if it nests a deque or defaultdict too deep.
  uint32_t result(uint32_t pair, uint32_t depth, uint64_t size, std::size_t pos) {
    if (depth > kMaxUnprotectedDepth && unprotected_[pair]) {
      die(kTooDeep, pos);
      return kNone;
    }
    return new_tag(kResult, pair, depth, size, kChosen);
  }

  // _grow: the target receives the tags stack_[from, to), which are now nested.
  bool grow(uint32_t target, std::size_t from, std::size_t to, std::size_t pos) {
    if (tags_[target].nested) {
      die(kRefused, pos);
      return false;
    }
    uint32_t depth = tags_[target].depth;
    uint64_t size = tags_[target].size;
    for (std::size_t i = from; i < to; ++i) {
      Tag& item = tags_[stack_[i]];
      item.nested = true;
      if (item.depth >= depth) {
        depth = item.depth + 1;
      }
      size = add_size(size, item.size);
    }
    Tag& tag = tags_[target];
    if (depth > kMaxDepth || (tag.kind == kResult && depth > kMaxUnprotectedDepth && unprotected_[tag.ref])) {
      die(kTooDeep, pos);
      return false;
    }
    tag.depth = static_cast<uint16_t>(depth);
    tag.size = size;
    return true;
  }

  // _Hashing.charge: `target` hashes every `step`-th of the tags stack_[from, to).
  bool charge_hashing(uint32_t target, std::size_t from, std::size_t to, std::size_t step, std::size_t pos) {
    uint64_t spent = 0;
    uint64_t chosen = tags_[target].chosen;
    uint64_t compared = 0;
    for (std::size_t i = from; i < to; i += step) {
      const Tag& item = tags_[stack_[i]];
      if (item.depth > kMaxKeyDepth) {
        die(kTooDeep, pos);
        return false;
      }
      spent = add_size(spent, item.size);
      if (item.hashk == kChosen) {
        // chosen * size, saturating: chosen < 2**32 (one per opcode), size <= kSizeCap
        const uint64_t cost = (item.size != 0 && chosen > kSizeCap / item.size) ? kSizeCap : chosen * item.size;
        compared = add_size(compared, cost);
        chosen += 1;
      }
    }
    tags_[target].chosen = std::min(chosen, kChosenCap);
    if (compared > colliding_left_) {
      die(kTooDeep, pos);
      return false;
    }
    colliding_left_ -= compared;
    if (spent > hash_left_) {
      die(kTooDeep, pos);
      return false;
    }
    hash_left_ -= spent;
    return true;
  }

  // _name_pair: a global's names are at most kMaxNameLength characters.
  bool name_fits(const py::object& name, std::size_t pos) {
    if (static_cast<std::size_t>(PyUnicode_GET_LENGTH(name.ptr())) > kMaxNameLength) {
      die(kMalformed, pos);
      return false;
    }
    return true;
  }

  void mark_mutated(uint32_t pair, uint8_t bit) {
    if (mutated_[pair] == 0) {
      mutated_order_.push_back(pair);
    }
    mutated_[pair] |= bit;
  }

  // _mutate: `target` receives the items stack_[from, to).
  bool mutate(uint32_t target, uint8_t bit, uint8_t own_kind, std::size_t from, std::size_t to, std::size_t pos) {
    Tag& tag = tags_[target];
    if (tag.kind == kResult) {
      if (tag.built && bit != kSetitemBit) {
        die(kRefused, pos);
        return false;
      }
      mark_mutated(tag.ref, bit);
    } else if (tag.kind != own_kind) {
      die(kRefused, pos);
      return false;
    }
    return grow(target, from, to, pos);
  }

  // A str for texts_[index] (a decoded text, or ASCII bytes decoded now).
  py::object text(uint32_t index) {
    Text& entry = texts_[index];
    if (!entry.decoded) {
      PyObject* s = PyUnicode_DecodeUTF8(reinterpret_cast<const char*>(data_ + entry.offset),
                                         static_cast<Py_ssize_t>(entry.length), "surrogatepass");
      if (s == nullptr) {
        throw py::error_already_set();
      }
      entry.decoded = py::reinterpret_steal<py::object>(s);
    }
    return entry.decoded;
  }

  // Records a string literal's bytes, with its str (`decoded`, a new reference) or nullptr for ASCII bytes,
  // decoded only if a STACK_GLOBAL takes them as a name.
  uint32_t add_text(std::size_t offset, std::size_t length, PyObject* decoded) {
    texts_.push_back({offset, length, py::reinterpret_steal<py::object>(decoded)});
    return static_cast<uint32_t>(texts_.size() - 1);
  }

  // Decode with `codec` ("utf-8-sp", "utf-8", "raw-unicode-escape"); nullptr and dead on failure.
  PyObject* decode(const char* codec, std::size_t offset, std::size_t length, std::size_t pos) {
    const char* bytes = reinterpret_cast<const char*>(data_ + offset);
    const auto size = static_cast<Py_ssize_t>(length);
    PyObject* s;
    if (std::strcmp(codec, "raw-unicode-escape") == 0) {
      s = PyUnicode_DecodeRawUnicodeEscape(bytes, size, nullptr);
    } else {
      s = PyUnicode_DecodeUTF8(bytes, size, std::strcmp(codec, "utf-8-sp") == 0 ? "surrogatepass" : nullptr);
    }
    if (s == nullptr) {
      if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
        die(kMalformed, pos);
      } else {
        PyErr_Clear();
        defer(pos);
      }
    }
    return s;
  }

  bool ascii(std::size_t offset, std::size_t length) const {
    unsigned char any = 0;
    for (std::size_t i = offset; i < offset + length; ++i) {
      any |= data_[i];
    }
    return any < 0x80;
  }

  uint32_t intern_pair(py::object module, py::object name) {
    py::tuple pair = py::make_tuple(std::move(module), std::move(name));
    PyObject* known = PyDict_GetItemWithError(pair_index_.ptr(), pair.ptr());
    if (known != nullptr) {
      return static_cast<uint32_t>(PyLong_AsUnsignedLong(known));
    }
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
    const auto index = static_cast<uint32_t>(pairs_.size());
    pair_index_[pair] = py::int_(index);
    PyObject* module_name = PyTuple_GET_ITEM(pair.ptr(), 0);
    PyObject* qualname = PyTuple_GET_ITEM(pair.ptr(), 1);
    unprotected_.push_back(PyUnicode_CompareWithASCIIString(module_name, "collections") == 0 &&
                           (PyUnicode_CompareWithASCIIString(qualname, "deque") == 0 ||
                            PyUnicode_CompareWithASCIIString(qualname, "defaultdict") == 0));
    pairs_.push_back(pair);
    called_.push_back(0);
    instantiated_.push_back(0);
    mutated_.push_back(0);
    return index;
  }

  uint32_t top() const { return stack_.back(); }

  // One opcode of semantics.analyze; the bounds walk has accepted it. Any error stops the analysis (die).
  void analyze(unsigned char op, std::size_t start, uint64_t arg, std::size_t text_offset, std::size_t text_length) {
    const std::size_t frame = frame_size();
    const std::size_t size = stack_.size();
    switch (op) {
      case 0x94:  // MEMOIZE
        if (frame < 1) {
          return die(kMalformed, start);
        }
        memo_.push_back(top());
        return;
      case 'q':
      case 'r':
      case 'p':  // BINPUT, LONG_BINPUT, PUT
        if (frame < 1) {
          return die(kMalformed, start);
        }
        if (arg < memo_.size()) {
          memo_[static_cast<std::size_t>(arg)] = top();
        } else if (arg == memo_.size()) {
          memo_.push_back(top());
        } else {
          return defer(start);  // the walk's memo size and this memo disagree: cannot happen
        }
        return;
      case 'h':
      case 'j':
      case 'g':  // BINGET, LONG_BINGET, GET
        if (arg >= memo_.size()) {
          return die(kMalformed, start);
        }
        stack_.push_back(memo_[static_cast<std::size_t>(arg)]);
        return;
      case 'K':
      case 'J':
      case 'M':
      case 0x88:
      case 0x89:
      case 'N':
        stack_.push_back(kPrimTag);
        return;
      case 'G':
      case 'F':  // floats: hashes the stream can choose
        stack_.push_back(kChosenTag);
        return;
      case 0x8a:
      case 0x8b:  // LONG1, LONG4: up to 7 bytes an int hashes to itself; longer, 1 + its bytes / 8 to hash
        stack_.push_back(op == 0x8a && text_length <= 7 ? kPrimTag
                                                         : new_tag(kPrim, kNone, 0, 1 + text_length / 8, kChosen));
        return;
      case 'I':
      case 'L':  // text ints: up to 16 characters below 2**55
        stack_.push_back(text_length <= 16 ? kPrimTag : new_tag(kPrim, kNone, 0, 1 + text_length / 8, kChosen));
        return;
      case 0x8c:
      case 'X':
      case 0x8d: {  // SHORT_BINUNICODE, BINUNICODE, BINUNICODE8: utf-8, surrogatepass
        PyObject* decoded = nullptr;
        if (!ascii(text_offset, text_length)) {
          decoded = decode("utf-8-sp", text_offset, text_length, start);
          if (decoded == nullptr) {
            return;
          }
        }
        stack_.push_back(new_tag(kStr, add_text(text_offset, text_length, decoded), 0));
        return;
      }
      case 'V': {  // UNICODE: raw-unicode-escape
        PyObject* decoded = decode("raw-unicode-escape", text_offset, text_length, start);
        if (decoded == nullptr) {
          return;
        }
        stack_.push_back(new_tag(kStr, add_text(text_offset, text_length, decoded), 0));
        return;
      }
      case 'U':
      case 'T':
      case 'S':  // SHORT_BINSTRING, BINSTRING, STRING: text unknown (the unpickler's encoding decides)
        stack_.push_back(kUnknownStrTag);
        return;
      case 'C':
      case 'B':
      case 0x8e:
      case 0x96:
        stack_.push_back(kBytesTag);
        return;
      case 0x97:  // NEXT_BUFFER
        stack_.push_back(kBufferTag);
        return;
      case 'R': {  // REDUCE
        if (frame < 2) {
          return die(kMalformed, start);
        }
        const uint32_t args = stack_[size - 1], func = stack_[size - 2];
        if (tags_[func].kind != kGlobal || tags_[args].kind != kTuple) {
          return die(kRefused, start);
        }
        const uint32_t pair = tags_[func].ref;
        called_[pair] = 1;
        tags_[args].nested = true;
        const uint32_t made = result(pair, tags_[args].depth + 1, add_size(tags_[args].size, 1), start);
        if (made == kNone) {
          return;
        }
        stack_.pop_back();
        stack_.back() = made;
        return;
      }
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1, TUPLE2, TUPLE3: stack[-n:] = [tuple]; the frame must hold n items
        const std::size_t n = op == 0x85 ? 1 : op == 0x86 ? 2 : 3;
        if (frame < n) {
          return die(kMalformed, start);
        }
        uint32_t depth = 0;
        uint64_t tuple_size = 1;
        uint8_t hashk = kSecret;
        if (!container(size - n, size, start, &depth, &tuple_size, &hashk)) {
          return;
        }
        stack_.resize(size - n);
        stack_.push_back(new_tag(kTuple, kNone, depth, tuple_size, kHashOfItems[hashk]));
        return;
      }
      case '(':  // MARK
        fences_.push_back(size);
        return;
      case 't':
      case 'l':
      case 0x91:
      case 'd': {  // TUPLE, LIST, FROZENSET, DICT
        if (fences_.empty()) {
          return die(kMalformed, start);
        }
        const std::size_t from = fence();
        if (op == 'd' && (frame % 2)) {
          return die(kMalformed, start);
        }
        uint32_t depth = 0;
        uint64_t made_size = 1;
        uint8_t hashk = kSecret;
        if (!container(from, size, start, &depth, &made_size, &hashk)) {
          return;
        }
        const uint8_t kind = op == 't' ? kTuple : op == 'l' ? kList : op == 'd' ? kDict : kFrozenset;
        const uint8_t made_hashk = kind == kTuple       ? kHashOfItems[hashk]
                                   : kind == kFrozenset ? kFrozenHashOfItems[hashk]
                                                        : kSecret;
        const uint32_t made = new_tag(kind, kNone, depth, made_size, made_hashk);
        if ((op == 'd' && !charge_hashing(made, from, size, 2, start)) ||
            (op == 0x91 && !charge_hashing(made, from, size, 1, start))) {
          return;
        }
        stack_.resize(from);
        fences_.pop_back();
        stack_.push_back(made);
        return;
      }
      case 0x93: {  // STACK_GLOBAL
        if (frame < 2) {
          return die(kMalformed, start);
        }
        const Tag& name = tags_[stack_[size - 1]];
        const Tag& module = tags_[stack_[size - 2]];
        if (module.kind != kStr || name.kind != kStr || module.ref == kNone || name.ref == kNone) {
          return die(kRefused, start);
        }
        const uint32_t module_text = module.ref, name_text = name.ref;
        py::object module_name = text(module_text), qualname = text(name_text);
        if (!name_fits(module_name, start) || !name_fits(qualname, start)) {
          return;
        }
        const uint32_t pair = intern_pair(std::move(module_name), std::move(qualname));
        stack_.resize(size - 2);
        stack_.push_back(new_tag(kGlobal, pair, 0));
        return;
      }
      case '}':
        stack_.push_back(new_tag(kDict, kNone, 1));
        return;
      case ']':
        stack_.push_back(new_tag(kList, kNone, 1));
        return;
      case ')':
        stack_.push_back(new_tag(kTuple, kNone, 1, 1, kKnown));
        return;
      case 0x8f:
        stack_.push_back(new_tag(kSet, kNone, 1));
        return;
      case 'u':
      case 'e':
      case 0x90: {  // SETITEMS, APPENDS, ADDITEMS
        if (fences_.empty()) {
          return die(kMalformed, start);
        }
        const std::size_t from = fence();
        fences_.pop_back();
        if (op == 'u' && (frame % 2)) {
          return die(kMalformed, start);
        }
        if (from <= fence()) {  // the frame below is empty: stack[-1] raises
          return die(kMalformed, start);
        }
        const uint32_t target = stack_[from - 1];
        const uint8_t bit = op == 'u' ? kSetitemBit : op == 'e' ? kAppendBit : kAddBit;
        const uint8_t own = op == 'u' ? kDict : op == 'e' ? kList : kSet;
        if (!mutate(target, bit, own, from, size, start)) {
          return;
        }
        if ((op == 'u' && !charge_hashing(target, from, size, 2, start)) ||
            (op == 0x90 && !charge_hashing(target, from, size, 1, start))) {
          return;
        }
        stack_.resize(from);
        return;
      }
      case 's':
      case 'a': {  // SETITEM, APPEND
        const std::size_t n = op == 's' ? 2 : 1;
        if (frame < n + 1) {
          return die(kMalformed, start);
        }
        const uint32_t target = stack_[size - n - 1];
        if (!mutate(target, op == 's' ? kSetitemBit : kAppendBit, op == 's' ? kDict : kList, size - n, size,
                    start)) {
          return;
        }
        if (op == 's' && !charge_hashing(target, size - 2, size - 1, 1, start)) {
          return;
        }
        stack_.resize(size - n);
        return;
      }
      case 'b': {  // BUILD
        if (frame < 2) {
          return die(kMalformed, start);
        }
        const uint32_t inst = stack_[size - 2];
        if (tags_[inst].kind != kResult || tags_[inst].built) {
          return die(kRefused, start);
        }
        tags_[inst].built = true;
        mark_mutated(tags_[inst].ref, kBuildBit);
        if (!grow(inst, size - 1, size, start)) {
          return;
        }
        stack_.pop_back();
        return;
      }
      case 0x81:
      case 0x92: {  // NEWOBJ, NEWOBJ_EX
        std::size_t top_index = size;
        std::size_t available = frame;
        if (op == 0x92) {
          if (available < 1) {
            return die(kMalformed, start);
          }
          if (tags_[stack_[top_index - 1]].kind != kDict) {
            return die(kRefused, start);
          }
          top_index -= 1;
          available -= 1;
        }
        if (available < 2) {
          return die(kMalformed, start);
        }
        const uint32_t args = stack_[top_index - 1], cls = stack_[top_index - 2];
        if (tags_[cls].kind != kGlobal || tags_[args].kind != kTuple) {
          return die(kRefused, start);
        }
        const uint32_t pair = tags_[cls].ref;
        instantiated_[pair] = 1;
        uint32_t depth = tags_[args].depth;
        uint64_t made_size = add_size(tags_[args].size, 1);
        tags_[args].nested = true;
        if (op == 0x92) {
          Tag& kwargs = tags_[stack_[size - 1]];
          kwargs.nested = true;
          depth = std::max<uint32_t>(depth, kwargs.depth);
          made_size = add_size(made_size, kwargs.size);
        }
        const uint32_t made = result(pair, depth + 1, made_size, start);
        if (made == kNone) {
          return;
        }
        stack_.resize(top_index - 2);
        stack_.push_back(made);
        return;
      }
      case 'o': {  // OBJ: MARK cls arg1 ... argN OBJ
        if (fences_.empty()) {
          return die(kMalformed, start);
        }
        const std::size_t from = fence();
        if (frame == 0 || tags_[stack_[from]].kind != kGlobal) {
          return die(kRefused, start);
        }
        const uint32_t pair = tags_[stack_[from]].ref;
        called_[pair] = 1;
        uint32_t depth = 0;
        uint64_t args_size = 1;
        if (!container(from + 1, size, start, &depth, &args_size)) {
          return;
        }
        const uint32_t made = result(pair, depth, args_size, start);
        if (made == kNone) {
          return;
        }
        stack_.resize(from);
        fences_.pop_back();
        stack_.push_back(made);
        return;
      }
      case 'c':
      case 'i': {  // GLOBAL, INST: "module\nname\n"
        const void* newline = std::memchr(data_ + text_offset, '\n', text_length);
        if (newline == nullptr) {
          return defer(start);  // the walk found two lines: cannot happen
        }
        const auto module_length =
            static_cast<std::size_t>(static_cast<const unsigned char*>(newline) - (data_ + text_offset));
        PyObject* module = decode("utf-8", text_offset, module_length, start);
        if (module == nullptr) {
          return;
        }
        py::object module_object = py::reinterpret_steal<py::object>(module);
        PyObject* name = decode("utf-8", text_offset + module_length + 1, text_length - module_length - 1, start);
        if (name == nullptr) {
          return;
        }
        py::object name_object = py::reinterpret_steal<py::object>(name);
        if (!name_fits(module_object, start) || !name_fits(name_object, start)) {
          return;
        }
        const uint32_t pair = intern_pair(std::move(module_object), std::move(name_object));
        if (op == 'c') {
          stack_.push_back(new_tag(kGlobal, pair, 0));
          return;
        }
        if (fences_.empty()) {
          return die(kMalformed, start);
        }
        const std::size_t from = fence();
        called_[pair] = 1;
        uint32_t depth = 0;
        uint64_t args_size = 1;
        if (!container(from, size, start, &depth, &args_size)) {
          return;
        }
        const uint32_t made = result(pair, depth, args_size, start);
        if (made == kNone) {
          return;
        }
        stack_.resize(from);
        fences_.pop_back();
        stack_.push_back(made);
        return;
      }
      case '2':  // DUP
        if (frame < 1) {
          return die(kMalformed, start);
        }
        stack_.push_back(top());
        return;
      case '0':  // POP: the top value, or the MARK when the frame is empty
        if (frame > 0) {
          stack_.pop_back();
        } else if (fences_.empty()) {
          return die(kMalformed, start);
        } else {
          fences_.pop_back();
        }
        return;
      case '1':  // POP_MARK
        if (fences_.empty()) {
          return die(kMalformed, start);
        }
        stack_.resize(fence());
        fences_.pop_back();
        return;
      case 0x98: {  // READONLY_BUFFER
        if (frame < 1) {
          return die(kMalformed, start);
        }
        const uint8_t kind = tags_[top()].kind;
        if (kind != kBuffer && kind != kBytes) {
          return die(kRefused, start);
        }
        return;
      }
      case 0x80:
      case 0x95:  // PROTO, FRAME
        return;
      case 0x82:
      case 0x83:
      case 0x84:  // EXT1, EXT2, EXT4
        return die(kRefused, start);
      case '.':  // STOP (the walk checked that it ends the stream)
        if (!fences_.empty() || frame != 1) {
          return die(kMalformed, start);
        }
        return;
      default:  // PERSID and unknown opcodes: the walk refused them already
        return defer(start);
    }
  }

  py::tuple success() const {
    py::tuple globals(pairs_.size());
    for (std::size_t i = 0; i < pairs_.size(); ++i) {
      globals[i] = pairs_[i];
    }
    py::list called_list, instantiated_list, mutated_list;
    for (std::size_t i = 0; i < pairs_.size(); ++i) {
      if (called_[i]) {
        called_list.append(pairs_[i]);
      }
      if (instantiated_[i]) {
        instantiated_list.append(pairs_[i]);
      }
    }
    for (uint32_t pair : mutated_order_) {
      mutated_list.append(py::make_tuple(pairs_[pair], static_cast<int>(mutated_[pair])));
    }
    return py::make_tuple(
        static_cast<int>(kOk), 0,
        py::make_tuple(globals, called_list, instantiated_list, mutated_list, py::int_(buffers_)));
  }
};

py::tuple analyze_stream(const py::handle& obj, std::size_t collect_at) {
  BufferGuard guard;
  if (PyObject_GetBuffer(obj.ptr(), &guard.view, PyBUF_SIMPLE) != 0) {
    throw py::error_already_set();
  }
  guard.held = true;  // the export pins the bytes (a bytearray cannot resize) for the whole call
  Analyzer analyzer(static_cast<const unsigned char*>(guard.view.buf), static_cast<std::size_t>(guard.view.len),
                    collect_at);
  return analyzer.run();
}

}  // namespace semantics_native
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zerocopy_pickle native helpers (see zerocopy_pickle/native.py)";
  m.def("storage_from_buffer", &storage_from_buffer, py::arg("buffer"),
        "A CPU UntypedStorage over a writable buffer, holding the buffer's export while it lives.");
  m.def("jit_load_from_buffer", &jit_load_from_buffer, py::arg("buffer"), py::arg("device") = py::none(),
        "Import a TorchScript archive from a buffer without copying it; returns the C++ module.");
  m.def("analyze_stream", &semantics_native::analyze_stream, py::arg("stream"), py::arg("collect_at") = 1 << 16,
        "streamcheck.check_stream + semantics.analyze in one pass: (code, offset, payload); code 0 is success, "
        "payload (globals, called, instantiated, [(pair, mutated ops bitmask)], next_buffers).");
}
