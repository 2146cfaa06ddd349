// checkpoint_options.cpp — see checkpoint_options.hpp.
#include "io/checkpoint_options.hpp"

#include <mpi.h>

#include <algorithm>
#include <filesystem>

#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "io/checkpoint.hpp"

namespace zero3d {

namespace fs = std::filesystem;

ResumeTarget resume_target(const std::string& resume, const std::string& save_dir, const CheckpointOptions& o) {
  const bool latest = resume == "latest" || resume == "auto";
  const fs::path file = fs::path(save_dir) / kLatestUniversal;
  std::error_code ec;
  if (!o.load_universal || !latest || save_dir.empty() || !fs::exists(file, ec)) return {latest ? "latest" : resume, ""};
  // The tag file as DeepSpeed writes it (ds_to_universal.py): the tag's name, a line at most.
  std::string tag = read_regular_file(file.string(), "checkpoint tag file", 4096);
  while (!tag.empty() && (tag.back() == '\n' || tag.back() == '\r' || tag.back() == ' ')) tag.pop_back();
  const bool name = !tag.empty() && tag != "." && tag != ".." &&
                    std::all_of(tag.begin(), tag.end(), [](char c) { return c > 0x20 && c < 0x7f && c != '/'; });
  if (!name)
    throw InputError(file.string() + ": does not hold a tag name (checkpoint.load_universal resumes the tag it names)");
  return {(fs::path(save_dir) / tag).string(), file.string()};
}

bool resumable_checkpoint_exists(const std::string& save_dir, const CheckpointOptions& o) {
  std::error_code ec;
  return checkpoint_exists(save_dir) || (o.load_universal && fs::exists(fs::path(save_dir) / kLatestUniversal, ec));
}

int64_t resumed_step(const std::string& resume, const std::string& save_dir, const CheckpointOptions& o) {
  if (resume.empty() || (resume == "auto" && !resumable_checkpoint_exists(save_dir, o))) return -1;
  std::string tag = resume_target(resume, save_dir, o).spec;
  std::error_code ec;
  if (tag == "latest" && fs::is_regular_file(fs::path(save_dir) / "latest", ec))
    tag = read_regular_file((fs::path(save_dir) / "latest").string(), "checkpoint tag file", 4096);
  while (!tag.empty() && (tag.back() == '\n' || tag.back() == '\r' || tag.back() == '/')) tag.pop_back();
  return std::max<int64_t>(0, tag_step(fs::path(tag).filename().string()));
}

bool is_first_rank_of_node(MPI_Comm world) {
  int rank = 0, node_rank = 0;
  MPI_Comm_rank(world, &rank);
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  MPI_Comm_rank(node, &node_rank);
  MPI_Comm_free(&node);
  return node_rank == 0;
}

}  // namespace zero3d
