// test_cli_checkpoint_options.cpp — the `checkpoint` section (issue 18): load_universal,
// use_node_local_storage on two nodes, parallel_write.pipeline_stage.
//
// Two nodes on one machine: MPICH's Hydra launched with `-launcher fork -hosts n0:1,n1:1` places
// one rank on each of two "hosts" and runs both here; MPI then sees two nodes
// (MPI_COMM_TYPE_SHARED splits them). Storage of each node's own is a directory per rank, given
// to it in an MPMD launch (`... : ...`), as /local/ckpt would be a different disk on each node.
#include <algorithm>
#include <filesystem>
#include <fstream>

#include "support/cli_helpers.hpp"

using namespace cli;
namespace fs = std::filesystem;

namespace {

json checkpoint_config() {
  json j = tiny_config();
  j["zero_optimization"] = {{"stage", 2}};
  j["training"]["steps"] = 6;
  j["training"]["save_interval"] = 2;
  return j;
}

// Rank 0 on "node" n0 with save_dir dirs[0], rank 1 on n1 with dirs[1]; `args` for both.
Result run_on_two_nodes(const std::string& config, const std::string& out, const std::string dirs[2],
                        const std::string& args = "") {
  const std::string o = temp_path("two_nodes_stdout.txt"), e = temp_path("two_nodes_stderr.txt");
  std::string cmd = kMpiexec + " -launcher fork -hosts n0:1,n1:1";
  for (int r = 0; r < 2; ++r)
    cmd += std::string(r ? " :" : "") + " -n 1 " + kExe + " train " + config + " --output " + out +
           " --set training.save_dir=" + dirs[r] + " " + args;
  const int status = std::system((cmd + " >" + o + " 2>" + e).c_str());
  return Result{WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(o), slurp(e)};
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// use_node_local_storage: each node's first rank publishes the tag in its own directory beside
// its ranks' shards; resuming with the same ranks per node reads only what each node holds.
TEST(NodeLocalStorageCli, EachNodeKeepsItsShardsAndTheTagAndResumesFromThem) {
  json j = checkpoint_config();
  j["checkpoint"] = {{"use_node_local_storage", true}};
  const std::string config = write_config("nodelocal.json", j);
  const std::string dirs[2] = {temp_path("node0_disk"), temp_path("node1_disk")};
  const std::string full = temp_path("nodelocal_full");
  Result r = run_on_two_nodes(config, full, dirs);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<double> all = losses_of(read_metrics(full));
  ASSERT_EQ(all.size(), 6u);
  for (int node = 0; node < 2; ++node) {
    EXPECT_EQ(slurp(dirs[node] + "/latest"), "global_step6\n") << "node " << node;
    const std::string shard = node == 0 ? "rank_00000.h5" : "rank_00001.h5";
    EXPECT_EQ(entries(dirs[node] + "/global_step2"),
              (std::vector<std::string>{"index.h5", "manifest.json", shard, "zero3d.tag"}))
        << "node " << node;
  }
  // Resume at step 2 on the same two nodes: the same losses as the run that went on.
  const std::string resumed = temp_path("nodelocal_resumed");
  r = run_on_two_nodes(config, resumed, dirs, "--set training.resume=global_step2 training.save_interval=0");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(losses_of(read_metrics(resumed)), std::vector<double>(all.begin() + 2, all.end()));
  // Nodes whose `latest` name different tags (node 1's disk restored from an older copy): each
  // could read its own shard, so the run stops with exit 2 before training on.
  const std::string node1_latest = slurp(dirs[1] + "/latest");
  {
    std::ofstream(dirs[1] + "/latest") << "global_step2\n";
  }
  r = run_on_two_nodes(config, temp_path("nodelocal_split"), dirs, "--set training.resume=latest training.steps=8");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("the ranks found checkpoints of different steps (2 and 6)"), std::string::npos) << r.err;
  EXPECT_EQ(count(r.err, "different steps"), 1u) << r.err;  // one message, from rank 0
  EXPECT_EQ(slurp(dirs[0] + "/latest"), "global_step6\n") << "nothing was saved";
  std::ofstream(dirs[1] + "/latest") << node1_latest;
  // One rank on node 0 alone needs the other node's shard too: exit 2, naming it.
  r = run("train " + config + " --output " + temp_path("nodelocal_one") + " --set training.save_dir=" + dirs[0] +
              " training.resume=latest training.steps=8",
          1);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("rank_00001.h5: not on this node (checkpoint.use_node_local_storage)"), std::string::npos) << r.err;
}

// Consolidated 16-bit weights are written on rank 0 from every rank's shard: with node-local
// storage that works on one node and is refused at start-up on two, before anything is saved.
TEST(NodeLocalStorageCli, ConsolidatedWeightsNeedOneNode) {
  json j = checkpoint_config();
  j["bf16"] = {{"enabled", true}};
  j["zero_optimization"] = {{"stage", 3}, {"stage3_gather_16bit_weights_on_model_save", true}};
  j["checkpoint"] = {{"use_node_local_storage", true}};
  j["training"]["steps"] = 2;
  const std::string config = write_config("nodelocal_g16.json", j);
  Result r = run("validate " + config + " --world-size 2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("`zero_optimization.stage3_gather_16bit_weights_on_model_save`: one node only"),
            std::string::npos)
      << r.out;
  const std::string dirs[2] = {temp_path("g16_node0_disk"), temp_path("g16_node1_disk")};
  r = run_on_two_nodes(config, temp_path("g16_two_nodes"), dirs);
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("`checkpoint.use_node_local_storage` = true with "
                       "`zero_optimization.stage3_gather_16bit_weights_on_model_save` = true on 2 nodes"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(count(r.err, "on 2 nodes"), 1u) << r.err;  // one message, from rank 0
  EXPECT_FALSE(fs::exists(dirs[0] + "/latest"));
  // Two ranks on one node: one save_dir, and the consolidated weights beside the tag.
  const std::string one = temp_path("g16_one_node");
  r = run("train " + config + " --output " + one, 2);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(fs::exists(one + "/checkpoints/global_step2/hf/model.safetensors"));
}

// Without the key the two directories are one run's save_dir named two ways: refused before
// anything is written, naming the key on which the ranks differ.
TEST(NodeLocalStorageCli, WithoutItTheRanksMustShareOneSaveDir) {
  const std::string config = write_config("shared.json", checkpoint_config());
  const std::string dirs[2] = {temp_path("shared0"), temp_path("shared1")};
  const Result r = run_on_two_nodes(config, temp_path("shared_out"), dirs);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("ranks disagree on the configuration: training.save_dir"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dirs[1] + "/latest"));
}

// load_universal: DeepSpeed's `latest_universal` names the tag to resume (zero3d's own tags are
// universal: they load at any layout); without it, `latest` does.
TEST(LoadUniversalCli, LatestUniversalNamesTheTagToResume) {
  json j = checkpoint_config();
  const std::string config = write_config("universal.json", j), full = temp_path("universal_full");
  ASSERT_EQ(run("train " + config + " --output " + full, 2).code, 0);
  const std::vector<double> all = losses_of(read_metrics(full));
  ASSERT_EQ(all.size(), 6u);
  const std::string save_dir = full + "/checkpoints";
  std::ofstream(save_dir + "/latest_universal") << "global_step2";  // as ds_to_universal.py writes it
  j["checkpoint"] = {{"load_universal", true}};
  j["training"]["save_dir"] = save_dir;
  j["training"]["resume"] = "latest";
  j["training"]["save_interval"] = 0;
  const std::string universal = write_config("universal_on.json", j), resumed = temp_path("universal_resumed");
  Result r = run("train " + universal + " --output " + resumed, 1);  // one rank: another layout
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("latest_universal names " + save_dir + "/global_step2 (checkpoint.load_universal)"),
            std::string::npos)
      << r.out;
  expect_losses_close(losses_of(read_metrics(resumed)), std::vector<double>(all.begin() + 2, all.end()), 1e-5,
                      "resumed at np 1 from the np 2 tag latest_universal names");
  // The same config without load_universal follows `latest`: step 6, nothing left to train.
  j["checkpoint"]["load_universal"] = false;
  r = run("train " + write_config("universal_off.json", j) + " --output " + temp_path("universal_off"), 1);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("nothing to do"), std::string::npos) << r.out;
}

// validate verifies the tag train would open: with load_universal, the one latest_universal
// names (resume "latest" and "auto" alike), not the one `latest` names.
TEST(LoadUniversalCli, ValidateVerifiesTheTagLatestUniversalNames) {
  json j = checkpoint_config();
  const std::string config = write_config("universal_v.json", j), full = temp_path("universal_v_full");
  ASSERT_EQ(run("train " + config + " --output " + full, 1).code, 0);
  const std::string save_dir = full + "/checkpoints";
  std::ofstream(save_dir + "/latest_universal") << "global_step2";
  j["checkpoint"] = {{"load_universal", true}};
  j["training"]["save_dir"] = save_dir;
  for (const char* resume : {"latest", "auto"}) {
    j["training"]["resume"] = resume;
    const Result r = run("validate " + write_config("universal_v_on.json", j));
    ASSERT_EQ(r.code, 0) << resume << r.err;
    EXPECT_NE(r.out.find("resume  " + save_dir + "/global_step2: step 2 (verified, named by " + save_dir +
                         "/latest_universal)"),
              std::string::npos)
        << resume << r.out;
  }
  // A damaged universal tag fails validation; `latest` (global_step6) is intact and not what train reads.
  fs::remove(save_dir + "/global_step2/rank_00000.h5");
  Result r = run("validate " + write_config("universal_v_on.json", j));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.err.find("global_step2"), std::string::npos) << r.err;
  j["checkpoint"]["load_universal"] = false;
  r = run("validate " + write_config("universal_v_off.json", j));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("resume  " + save_dir + "/global_step6: step 6 (verified)"), std::string::npos) << r.out;
  // Only latest_universal: resume "auto" finds it (train would resume, not start fresh).
  fs::remove(save_dir + "/latest");
  std::ofstream(save_dir + "/latest_universal", std::ios::trunc) << "global_step4\n";
  j["checkpoint"]["load_universal"] = true;
  r = run("validate " + write_config("universal_v_on.json", j));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("resume  " + save_dir + "/global_step4: step 4 (verified, named by"), std::string::npos) << r.out;
}

TEST(CheckpointSectionCli, ValidateSaysWhatEachKeyDoesHere) {
  json j = checkpoint_config();
  j["checkpoint"] = {{"tag_validation", "fail"},
                     {"load_universal", true},
                     {"use_node_local_storage", false},
                     {"parallel_write", {{"pipeline_stage", false}}}};
  Result r = run("validate " + write_config("ckpt_section.json", j) + " --world-size 2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("`checkpoint.load_universal` = true: resume \"latest\" reads the tag from"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("`checkpoint.parallel_write.pipeline_stage` = false: DeepSpeed's data-parallel rank 0 then writes"),
            std::string::npos)
      << r.out;
  j["checkpoint"] = {{"tag_validation", "Sometimes"}};
  expect_one_line_rejection(run("validate " + write_config("ckpt_bad.json", j)),
                            "`checkpoint.tag_validation`: value \"Sometimes\" is not one of: Ignore, Warn, Fail");
  j["checkpoint"] = {{"writer", {{"type", "fast"}}}};
  expect_one_line_rejection(run("validate " + write_config("ckpt_writer.json", j)),
                            "`checkpoint.writer`: value {\"type\":\"fast\"}: zero3d does not have pluggable checkpoint writers");
}

}  // namespace
