// The source tree's shape as a specification (README "Layout"): the folders are layers, lowest
// first, and an include may only point to the including file's own folder or a lower one. No
// file includes itself back through a chain of others. kernels/ (the device layer) includes
// nothing from src/ but base/, and a backend folder (kernels/cpu, kernels/cuda) never includes
// another backend.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

namespace fs = std::filesystem;

// Lowest first. "kernels" is the root's kernels/ (with its backend folders); the rest are src/<name>.
const std::vector<std::string> kLayers = {"base", "text",    "kernels", "observe", "parallel", "model", "config",
                                          "io",   "optim",   "offload", "zero",    "train",    "infer", "cli"};
// Built only by an option of their own (the sanitizer's runtime defaults): no layer, includes nothing.
const std::set<std::string> kOutsideLayers = {"sanitize"};

struct SourceFile {
  std::string path;    // relative to the root: "src/zero/zero.cpp", "kernels/cpu/gemm.cpp"
  std::string layer;   // "zero", "kernels"
  std::string folder;  // "src/zero", "kernels/cpu"
  std::vector<std::string> includes;  // the quoted ones, as written
};

int rank_of(const std::string& layer) {
  const auto it = std::find(kLayers.begin(), kLayers.end(), layer);
  return it == kLayers.end() ? -1 : static_cast<int>(it - kLayers.begin());
}

bool is_source(const fs::path& p) {
  const std::string e = p.extension().string();
  return e == ".hpp" || e == ".cpp" || e == ".h" || e == ".cu" || e == ".cuh";
}

std::vector<SourceFile> read_tree(const fs::path& root, std::vector<std::string>& problems) {
  std::vector<SourceFile> files;
  static const std::regex include_line(R"re(^\s*#\s*include\s*"([^"]+)")re");
  for (const char* top : {"src", "kernels"}) {
    if (!fs::exists(root / top)) continue;
    for (const auto& entry : fs::recursive_directory_iterator(root / top)) {
      if (!entry.is_regular_file() || !is_source(entry.path())) continue;
      SourceFile f;
      f.path = fs::relative(entry.path(), root).generic_string();
      f.folder = fs::path(f.path).parent_path().generic_string();
      if (std::string(top) == "kernels") {
        f.layer = "kernels";
      } else {
        const std::string rest = f.path.substr(4);  // after "src/"
        const size_t slash = rest.find('/');
        f.layer = slash == std::string::npos ? "" : rest.substr(0, slash);
        if (kOutsideLayers.count(f.layer)) continue;
        if (rank_of(f.layer) < 0) {
          problems.push_back(f.path + " is in no layer (src/<layer>/ for one of the README's folders)");
          continue;
        }
      }
      std::ifstream in(entry.path());
      std::string line;
      std::smatch m;
      while (std::getline(in, line))
        if (std::regex_search(line, m, include_line)) f.includes.push_back(m[1]);
      files.push_back(std::move(f));
    }
  }
  std::sort(files.begin(), files.end(), [](const SourceFile& a, const SourceFile& b) { return a.path < b.path; });
  return files;
}

// Every problem of the tree at `root`, one line each; empty when the layering holds.
std::vector<std::string> layering_problems(const fs::path& root) {
  std::vector<std::string> problems;
  const std::vector<SourceFile> files = read_tree(root, problems);
  std::map<std::string, const SourceFile*> by_path;
  for (const SourceFile& f : files) by_path[f.path] = &f;
  std::map<std::string, std::vector<std::string>> edges;
  for (const SourceFile& f : files) {
    for (const std::string& inc : f.includes) {
      // Includes name their folder: "kernels/…" from the root, everything else under src/.
      const std::string target = inc.rfind("kernels/", 0) == 0 ? inc : "src/" + inc;
      const auto it = by_path.find(target);
      if (it == by_path.end()) {
        problems.push_back(f.path + " includes \"" + inc + "\", which is no file of a layer (name the folder)");
        continue;
      }
      const SourceFile& t = *it->second;
      edges[f.path].push_back(t.path);
      if (rank_of(t.layer) > rank_of(f.layer))
        problems.push_back(f.path + " includes \"" + inc + "\": " + f.layer + "/ sits below " + t.layer + "/");
      const bool f_backend = f.folder.rfind("kernels/", 0) == 0, t_backend = t.folder.rfind("kernels/", 0) == 0;
      if (f_backend && t_backend && f.folder != t.folder)
        problems.push_back(f.path + " includes \"" + inc + "\": one backend never includes another");
    }
  }
  // Include cycles: a depth-first search that reports each back edge's cycle once.
  std::map<std::string, int> state;  // 0 new, 1 on the stack, 2 done
  std::vector<std::string> stack;
  std::function<void(const std::string&)> visit = [&](const std::string& p) {
    state[p] = 1;
    stack.push_back(p);
    for (const std::string& q : edges[p]) {
      if (state[q] == 1) {
        std::string cycle;
        for (auto it = std::find(stack.begin(), stack.end(), q); it != stack.end(); ++it) cycle += *it + " -> ";
        problems.push_back("include cycle: " + cycle + q);
      } else if (state[q] == 0) {
        visit(q);
      }
    }
    stack.pop_back();
    state[p] = 2;
  };
  for (const SourceFile& f : files)
    if (state[f.path] == 0) visit(f.path);
  return problems;
}

std::string joined(const std::vector<std::string>& lines) {
  std::ostringstream out;
  for (const std::string& l : lines) out << "\n  " << l;
  return out.str();
}

TEST(SourceTree, EveryIncludeNamesItsFolderAndPointsDownTheLayers) {
  const std::vector<std::string> problems = layering_problems(ZERO3D_SOURCE_DIR);
  EXPECT_TRUE(problems.empty()) << problems.size() << " problems:" << joined(problems);
}

TEST(SourceTree, EveryLayerHasSources) {
  std::vector<std::string> ignored;
  const std::vector<SourceFile> files = read_tree(ZERO3D_SOURCE_DIR, ignored);
  for (const std::string& layer : kLayers)
    EXPECT_TRUE(std::any_of(files.begin(), files.end(), [&](const SourceFile& f) { return f.layer == layer; }))
        << layer << "/ holds no source file: the README's layer list and the tree disagree";
}

// The check itself fails where it should: a small tree with each kind of fault.
class WrongTree : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("zero3d_layering_" + std::to_string(::getpid()));
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  void write(const std::string& path, const std::string& text) {
    fs::create_directories((root_ / path).parent_path());
    std::ofstream(root_ / path) << text;
  }
  bool reports(const std::string& needle) {
    const std::vector<std::string> p = layering_problems(root_);
    return std::any_of(p.begin(), p.end(), [&](const std::string& l) { return l.find(needle) != std::string::npos; });
  }
  fs::path root_;
};

TEST_F(WrongTree, AnUpwardIncludeIsReported) {
  write("src/base/errors.hpp", "#pragma once\n");
  write("src/zero/zero.hpp", "#pragma once\n#include \"base/errors.hpp\"\n");
  write("src/base/digest.cpp", "#include \"zero/zero.hpp\"\n");
  EXPECT_TRUE(reports("src/base/digest.cpp includes \"zero/zero.hpp\": base/ sits below zero/"));
  EXPECT_FALSE(reports("src/zero/zero.hpp"));  // zero -> base points down
}

TEST_F(WrongTree, AKernelReachingIntoTheModelIsReported) {
  write("src/model/model.hpp", "#pragma once\n");
  write("kernels/gelu.hpp", "#pragma once\n#include \"model/model.hpp\"\n");
  EXPECT_TRUE(reports("kernels/gelu.hpp includes \"model/model.hpp\": kernels/ sits below model/"));
}

TEST_F(WrongTree, ACycleInsideOneFolderIsReported) {
  write("src/io/a.hpp", "#pragma once\n#include \"io/b.hpp\"\n");
  write("src/io/b.hpp", "#pragma once\n#include \"io/a.hpp\"\n");
  EXPECT_TRUE(reports("include cycle: src/io/a.hpp -> src/io/b.hpp -> src/io/a.hpp"));
}

TEST_F(WrongTree, BackendsDoNotIncludeEachOtherAndBareNamesAreReported) {
  write("kernels/cpu/gemm.cpp", "#include \"kernels/cuda/gemm.cuh\"\n");
  write("kernels/cuda/gemm.cuh", "#pragma once\n");
  write("src/train/engine.cpp", "#include \"engine.hpp\"\n");
  write("src/misc.cpp", "\n");
  EXPECT_TRUE(reports("kernels/cpu/gemm.cpp includes \"kernels/cuda/gemm.cuh\": one backend never includes another"));
  EXPECT_TRUE(reports("src/train/engine.cpp includes \"engine.hpp\", which is no file of a layer"));
  EXPECT_TRUE(reports("src/misc.cpp is in no layer"));
}

}  // namespace
