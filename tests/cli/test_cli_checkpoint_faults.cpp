// test_cli_checkpoint_faults.cpp — checkpoints never publish a bad tag and never delete what is
// not theirs (issue 20, items 1-7): a fault at every I/O point of a save, a full disk, foreign
// directories in save_dir, and a corruption suite, each checked through resume and `inspect`.
// The model is the t.json (V 256, T 64, 2 layers, C 64) on one or two ranks.
#include <sys/mount.h>
#include <unistd.h>

#include <filesystem>
#include <map>

#include "io/checkpoint.hpp"
#include "io/h5.hpp"
#include "support/cli_helpers.hpp"

using namespace cli;
namespace fs = std::filesystem;

namespace {

json t_config() {
  return json{{"train_batch_size", 8},
              {"train_micro_batch_size_per_gpu", 4},
              {"model", {{"vocab_size", 256}, {"n_positions", 64}, {"n_layer", 2}, {"n_head", 2}, {"n_embd", 64}}},
              {"training", {{"steps", 2}, {"save_interval", 1}}}};
}

std::string t_json() {
  static const std::string path = write_config("ckfault_t.json", t_config());
  return path;
}

void sh(const std::string& cmd) { ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd; }

Result train(const std::string& out, const std::string& args, int np = 1, const std::string& prefix = "") {
  return run("train " + t_json() + " --output " + out + " " + args, np, prefix);
}

std::string fresh(const std::string& name) {
  const std::string dir = temp_path(name);
  std::system(("rm -rf " + dir).c_str());
  return dir;
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

// A save directory's user files that no save may touch, and a check that they are untouched.
void add_foreign(const std::string& ck) {
  sh("mkdir -p " + ck + "/results.tmp " + ck + "/my_model " + ck + "/old_notes.old.tmp && echo keep > " + ck +
     "/results.tmp/data.txt && echo h5 > " + ck + "/my_model/index.h5 && echo n > " + ck + "/old_notes.old.tmp/x");
}
void expect_foreign(const std::string& ck, const std::string& when) {
  EXPECT_EQ(slurp(ck + "/results.tmp/data.txt"), "keep\n") << when;
  EXPECT_EQ(slurp(ck + "/my_model/index.h5"), "h5\n") << when;
  EXPECT_EQ(slurp(ck + "/old_notes.old.tmp/x"), "n\n") << when;
}

// Checkpoints of the model at np 2: this run's global_step1/2 and another run's
// global_step2 (other seed, same shapes), built once.
struct Reference {
  std::string ck, other_ck;
};
const Reference& reference() {
  static Reference ref = [] {
    Reference r;
    const std::string a = fresh("ckfault_ref"), b = fresh("ckfault_other");
    EXPECT_EQ(train(a, "", 2).code, 0);
    EXPECT_EQ(train(b, "--set training.seed=99", 2).code, 0);
    r.ck = a + "/checkpoints";
    r.other_ck = b + "/checkpoints";
    return r;
  }();
  return ref;
}

std::string copy_tag(const std::string& name, const std::string& from = "") {
  const std::string dst = fresh(name);
  sh("cp -r " + (from.empty() ? reference().ck + "/global_step2" : from) + " " + dst);
  return dst;
}

void flip_byte(const std::string& path, std::streamoff at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(at);
  f.write(&c, 1);
}

// Same-length replacement of `from` by `to` inside a binary file; false when absent.
bool edit_bytes(const std::string& path, const std::string& from, const std::string& to) {
  std::string data = slurp(path);
  const size_t at = data.find(from);
  if (at == std::string::npos || from.size() != to.size()) return false;
  data.replace(at, from.size(), to);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << data;
  return true;
}

// Resume from `tag_dir` and `inspect` it: both exit 2 with a message naming `file`.
void expect_rejected(const std::string& tag_dir, const std::string& file, const std::string& extra = "") {
  const Result r = train(fresh("ckfault_resume"), "--set training.steps=3 --set training.resume=" + tag_dir + extra);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find(file), std::string::npos) << "resume does not name " << file << ": " << r.err;
  EXPECT_LE(count(r.err, "\n"), 2u) << r.err;
  const Result i = run("inspect " + tag_dir);
  EXPECT_EQ(i.code, 2) << i.err;
  EXPECT_NE(i.err.find(file), std::string::npos) << "inspect does not name " << file << ": " << i.err;
}

// Walks ZERO3D_IO_FAULT=<op>:n:<how> over every I/O point of kind op (any: all kinds) of the
// save that `args` makes from a copy of `base`, until a run meets no fault. After each faulted
// run `latest` names a tag that loads and user files are untouched: a failed save (enospc) is
// checked with `inspect`; after a kill the next run resumes from `latest` and saves, and then no
// stale save of this run is left. Returns the number of points.
int walk_faults(const std::string& base, const std::string& args, const std::string& op, const std::string& how) {
  int n = 1;
  for (;; ++n) {
    const std::string work = fresh("ckfault_walk"), ck = work + "/checkpoints";
    sh("cp -a " + base + " " + work);
    const std::string at = how + " at " + op + " point " + std::to_string(n);
    const Result r = train(work, args, 1, "ZERO3D_IO_FAULT=" + op + ":" + std::to_string(n) + ":" + how);
    // Past the last point of the save (a failed keep_last removal only warns: nothing is lost).
    const bool warned = r.err.find("warning: keep_last") != std::string::npos;
    if (r.code == 0 && !warned) break;
    const std::string latest = trim(slurp(ck + "/latest"));
    EXPECT_TRUE(latest == "global_step2" || latest == "global_step3") << at << ": latest = \"" << latest << "\"";
    expect_foreign(ck, at);
    if (how == "enospc") {
      if (!warned) {
        EXPECT_EQ(r.code, 1) << at << ": " << r.err;
        EXPECT_NE(r.err.find("No space left on device"), std::string::npos) << at << ": " << r.err << r.out.substr(r.out.size() > 600 ? r.out.size() - 600 : 0);
        EXPECT_NE(r.err.find(ck), std::string::npos) << at << ": the message names no file: " << r.err;
        EXPECT_LE(count(r.err, "\n"), 2u) << at << ": " << r.err;
      }
      const Result i = run("inspect " + ck);
      EXPECT_EQ(i.code, 0) << at << ": latest (" << latest << ") does not load: " << i.err;
    } else {
      const Result next = train(work, "--set training.steps=4 --set training.resume=latest --set training.keep_last=1");
      EXPECT_EQ(next.code, 0) << at << ": latest (" << latest << ") does not resume: " << next.err;
      EXPECT_EQ(trim(slurp(ck + "/latest")), "global_step4") << at;
      for (const auto& e : fs::directory_iterator(ck)) {
        const std::string name = e.path().filename().string();
        EXPECT_TRUE(name == "results.tmp" || name == "old_notes.old.tmp" || name.find(".tmp") == std::string::npos)
            << at << ": stale " << name << " left behind";
      }
      expect_foreign(ck, at + ", after the next run");
      // The step's record is written before its save: a kill anywhere in the save loses no record.
      std::vector<int64_t> steps;
      for (const json& row : read_metrics(work)) steps.push_back(row.at("step").get<int64_t>());
      EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4})) << at << ": every step's record, once";
    }
    if (n > 200) {
      ADD_FAILURE() << "ZERO3D_IO_FAULT never ran out of points";
      break;
    }
  }
  return n - 1;
}

// A run with global_step1 and global_step2 (latest) plus user files in save_dir.
const std::string& two_step_base() {
  static const std::string base = [] {
    const std::string dir = fresh("ckfault_base2");
    EXPECT_EQ(train(dir, "").code, 0);
    add_foreign(dir + "/checkpoints");
    return dir;
  }();
  return base;
}

}  // namespace

TEST(CheckpointDigest, Xxh64MatchesTheReferenceVectorsInOnePieceAndStreamed) {
  EXPECT_EQ(zero3d::xxh64("", 0), 0xEF46DB3751D8E999ULL);
  EXPECT_EQ(zero3d::xxh64("a", 1), 0xD24EC4F1A98C6E5BULL);
  EXPECT_EQ(zero3d::xxh64("abc", 3), 0x44BC2CF5AD770999ULL);
  const std::string long_text = "Nobody inspects the spammish repetition";
  EXPECT_EQ(zero3d::xxh64(long_text.data(), long_text.size()), 0xFBCEA83C8A378BF1ULL);
  std::string big;
  for (int i = 0; i < 1000; ++i) big += static_cast<char>(i * 7 + 3);
  for (size_t step : {1u, 7u, 31u, 32u, 33u, 500u}) {
    zero3d::Xxh64 x;
    for (size_t at = 0; at < big.size(); at += step) x.update(big.data() + at, std::min(step, big.size() - at));
    EXPECT_EQ(x.digest(), zero3d::xxh64(big.data(), big.size())) << "pieces of " << step;
  }
}

// Items 1, 2, 3, 6: a failed write, fsync, close or rename anywhere in a save (shards, index,
// manifest, latest.tmp, rotation) fails it with exit 1 naming the file; a kill there leaves a
// loadable `latest` that the next run resumes from.
TEST(CheckpointFaults, FailedOrKilledIoAtEveryPointOfASaveLeavesLatestLoadable) {
  const std::string args = "--set training.steps=3 --set training.resume=latest --set training.keep_last=1";
  const int points = walk_faults(two_step_base(), args, "any", "enospc");
  EXPECT_GE(points, 20) << "the save has fewer I/O points than expected: is ZERO3D_IO_FAULT wired?";
  EXPECT_EQ(walk_faults(two_step_base(), args, "any", "kill"), points);
}

// Item 4: re-saving an existing tag (resumed from global_step2, global_step3 exists) killed at
// every rename, including between moving the old tag aside and publishing the new one.
TEST(CheckpointFaults, ReSavingAnExistingTagKilledAtEveryPointKeepsLatestLoadable) {
  static const std::string base = [] {
    const std::string dir = fresh("ckfault_base3");
    EXPECT_EQ(train(dir, "--set training.steps=3").code, 0);
    add_foreign(dir + "/checkpoints");
    return dir;
  }();
  const std::string args = "--set training.steps=3 --set training.resume=global_step2";
  EXPECT_GE(walk_faults(base, args, "rename", "kill"), 4);
}

// A re-save killed between moving its tag aside and publishing leaves `latest` naming a missing
// directory: the next start puts the complete copy back, even when it has nothing to train,
// so tools that follow `latest` (h5dump) read it again.
TEST(CheckpointFaults, TheNextStartPutsATagMovedAsideByAKilledReSaveBackInPlace) {
  const std::string out = fresh("ckfault_aside"), ck = out + "/checkpoints";
  ASSERT_EQ(train(out, "--set training.steps=3").code, 0);
  sh("mv " + ck + "/global_step3 " + ck + "/global_step3.old.tmp");  // the state such a kill leaves
  const Result r = train(out, "--set training.steps=3 --set training.resume=latest");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("nothing to do"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(ck + "/global_step3/index.h5"));
  EXPECT_FALSE(fs::exists(ck + "/global_step3.old.tmp"));
}

// Item 1 across ranks: one rank's failed or killed write fails the whole save; the failure is
// agreed (exit 1, one message naming that rank's shard) and `latest` still loads.
TEST(CheckpointFaults, OneRanksFailedShardFailsTheSaveOnEveryRank) {
  const std::string base = fresh("ckfault_np2");
  ASSERT_EQ(train(base, "", 2).code, 0);
  for (const char* fault : {"close:1:eio:1", "fsync:1:enospc:1", "write:2:kill:1"}) {
    SCOPED_TRACE(fault);
    const std::string work = fresh("ckfault_np2_walk"), ck = work + "/checkpoints";
    sh("cp -a " + base + " " + work);
    const std::string args = "--set training.steps=3 --set training.resume=latest";
    const Result r = train(work, args, 2, std::string("ZERO3D_IO_FAULT=") + fault);
    EXPECT_NE(r.code, 0);
    if (std::string(fault).find("kill") == std::string::npos) {
      EXPECT_EQ(r.code, 1) << r.err;
      EXPECT_EQ(count(r.err, "rank_00001.h5"), 1u) << r.err;
      EXPECT_EQ(count(r.err, "\n"), 1u) << r.err;
    }
    EXPECT_EQ(trim(slurp(ck + "/latest")), "global_step2");
    const Result next = train(work, args, 2);
    EXPECT_EQ(next.code, 0) << next.err;
    EXPECT_EQ(trim(slurp(ck + "/latest")), "global_step3");
  }
}

// Items 1 and 6 with a real full disk: the disk fills while writing a shard or index.h5 of the
// first or the second save (tmpfs sizes around one and two saves of the model at np 2;
// HDF5 1.10 crashed in MPI_Finalize when its final flush of a file failed). Needs root to
// mount; skipped otherwise.
TEST(CheckpointFaults, FullDiskFailsTheSaveWithOneMessageExitOneAndNoCrash) {
  const std::string mnt = fresh("ckfault_tmpfs");
  sh("mkdir -p " + mnt);
  if (::geteuid() != 0 || ::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=1480k") != 0)
    GTEST_SKIP() << "needs root to mount a small tmpfs";
  ::umount(mnt.c_str());
  for (const char* size : {"1480k", "2200k", "2960k"}) {
    SCOPED_TRACE(std::string("tmpfs of ") + size);
    ASSERT_EQ(::mount("tmpfs", mnt.c_str(), "tmpfs", 0, (std::string("size=") + size).c_str()), 0);
    const Result r = train(fresh("ckfault_full"), "--set training.steps=3 --set training.save_dir=" + mnt, 2);
    EXPECT_EQ(r.code, 1) << r.err;
    EXPECT_NE(r.err.find(mnt + "/global_step"), std::string::npos) << r.err;
    EXPECT_LE(count(r.err, "\n"), 2u) << "one message, no backtrace: " << r.err;
    EXPECT_EQ(r.err.find("signal"), std::string::npos) << r.err;
    for (const auto& e : fs::directory_iterator(mnt))
      EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << "the failed save was not removed: " << e.path();
    if (fs::exists(mnt + "/latest")) {
      const Result i = run("inspect " + mnt);
      EXPECT_EQ(i.code, 0) << i.err;
    }
    ::umount(mnt.c_str());
  }
}

// Item 3: neither the stale-save cleanup nor keep_last touches what this run family did not write.
TEST(CheckpointCleanup, ForeignDirectoriesAndOtherRunsTagsSurviveSavesAndRotation) {
  const std::string out = fresh("ckfault_foreign"), ck = out + "/checkpoints";
  sh("mkdir -p " + ck);
  add_foreign(ck);
  sh("cp -r " + reference().other_ck + "/global_step1 " + ck + "/global_step0");  // a zero3d tag of another run
  const Result r = train(out, "--set training.keep_last=1", 2);
  ASSERT_EQ(r.code, 0) << r.err;
  expect_foreign(ck, "after keep_last=1");
  EXPECT_TRUE(fs::exists(ck + "/global_step0/index.h5")) << "another run's tag was rotated away";
  EXPECT_FALSE(fs::exists(ck + "/global_step1")) << "keep_last did not rotate this run's own tag";
  EXPECT_EQ(trim(slurp(ck + "/latest")), "global_step2");
  // A save whose tag directory exists but is not this run family's refuses to replace it.
  sh("rm -rf " + out + "/x && mkdir -p " + out + "/x && cp -r " + reference().other_ck + "/global_step1 " + out +
     "/x/global_step1");
  const Result clash = train(out, "--set training.save_dir=" + out + "/x");
  EXPECT_EQ(clash.code, 2) << clash.err;
  EXPECT_NE(clash.err.find(out + "/x/global_step1"), std::string::npos) << clash.err;
  EXPECT_TRUE(fs::exists(out + "/x/global_step1/manifest.json"));
}

// A run writes only what is its own: a fresh run into the save_dir of an earlier run, a save_dir
// holding a foreign tag the run would save, or an output directory holding files no zero3d run
// wrote, all stop at start-up (exit 2, naming the path) with nothing written; `validate` says the same.
TEST(CheckpointOwnership, RunsThatWouldOverwriteWhatIsNotTheirsStopBeforeWritingAnything) {
  const std::string earlier = fresh("own_earlier"), ck = earlier + "/checkpoints";
  ASSERT_EQ(train(earlier, "--set training.steps=3").code, 0);
  const std::string before = slurp(ck + "/global_step2/manifest.json"), metrics = slurp(earlier + "/metrics.jsonl");
  for (const std::string& cmd : {"train " + t_json() + " --output " + earlier + " --set training.seed=5",
                                 "validate " + t_json() + " --set training.output_dir=" + earlier}) {
    const Result r = run(cmd);
    EXPECT_EQ(r.code, 2) << cmd << ": " << r.err;
    EXPECT_NE(r.err.find(ck + "/latest"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("training.resume \"auto\""), std::string::npos) << "the message names the way on: " << r.err;
    EXPECT_EQ(count(r.err, "\n"), 1u) << r.err;
  }
  EXPECT_EQ(trim(slurp(ck + "/latest")), "global_step3");
  EXPECT_EQ(slurp(ck + "/global_step2/manifest.json"), before);
  EXPECT_EQ(slurp(earlier + "/metrics.jsonl"), metrics);
  const Result resumed = train(earlier, "--set training.steps=4 --set training.resume=auto");  // the way on
  EXPECT_EQ(resumed.code, 0) << resumed.err;
  EXPECT_EQ(trim(slurp(ck + "/latest")), "global_step4");

  // A foreign global_step1 in save_dir is found before step 1 trains, not at its save.
  const std::string clash = fresh("own_clash");
  sh("mkdir -p " + clash + "/checkpoints/global_step1 && echo theirs > " + clash + "/checkpoints/global_step1/model.pt");
  const Result c = train(clash, "");
  EXPECT_EQ(c.code, 2) << c.err;
  EXPECT_NE(c.err.find(clash + "/checkpoints/global_step1"), std::string::npos) << c.err;
  EXPECT_FALSE(fs::exists(clash + "/metrics.jsonl")) << "the clash was found only after training began";
  EXPECT_EQ(slurp(clash + "/checkpoints/global_step1/model.pt"), "theirs\n");
  // ...but one the run will never save (step 0, or past training.steps) is left alone.
  sh("mv " + clash + "/checkpoints/global_step1 " + clash + "/checkpoints/global_step100");
  EXPECT_EQ(train(clash, "").code, 0);
  EXPECT_EQ(slurp(clash + "/checkpoints/global_step100/model.pt"), "theirs\n");

  // An output directory with someone's config.json and no zero3d run's lock.
  const std::string theirs = fresh("own_foreign_out");
  sh("mkdir -p " + theirs + " && echo '{\"mine\": 1}' > " + theirs + "/config.json");
  const Result f = train(theirs, "");
  EXPECT_EQ(f.code, 2) << f.err;
  EXPECT_NE(f.err.find(theirs + ": holds config.json"), std::string::npos) << f.err;
  EXPECT_EQ(slurp(theirs + "/config.json"), "{\"mine\": 1}\n");
  EXPECT_FALSE(fs::exists(theirs + "/checkpoints"));
}

// --- corruption suite (items 5 and 7): each defect is found by resume and by inspect ---------

TEST(CheckpointCorruption, TruncatedShardAndIndex) {
  std::string tag = copy_tag("ckc_trunc_shard");
  sh("truncate -s 300000 " + tag + "/rank_00001.h5");
  expect_rejected(tag, "rank_00001.h5");
  tag = copy_tag("ckc_trunc_index");
  sh("truncate -s 2000 " + tag + "/index.h5");
  expect_rejected(tag, "index.h5");
}

TEST(CheckpointCorruption, BitFlipsInShardDataAndHdf5Metadata) {
  std::string tag = copy_tag("ckc_flip_data");
  flip_byte(tag + "/rank_00000.h5", 400000);  // inside the chunked data
  expect_rejected(tag, "rank_00000.h5");
  tag = copy_tag("ckc_flip_meta");
  flip_byte(tag + "/rank_00001.h5", 60);  // the superblock / root object header
  expect_rejected(tag, "rank_00001.h5");
}

TEST(CheckpointCorruption, BitFlipsAnywhereInIndexAreFound) {
  const auto size = static_cast<std::streamoff>(fs::file_size(reference().ck + "/global_step2/index.h5"));
  for (std::streamoff at : {std::streamoff(8), std::streamoff(700), size / 3, size / 2, size - 40}) {
    SCOPED_TRACE("byte " + std::to_string(at));
    const std::string tag = copy_tag("ckc_flip_index");
    flip_byte(tag + "/index.h5", at);
    expect_rejected(tag, "index.h5");
  }
}

TEST(CheckpointCorruption, ShardsAndIndexFromAnotherTagOrRunAreFound) {
  std::string tag = copy_tag("ckc_swap_tag");
  sh("cp " + reference().ck + "/global_step1/rank_00000.h5 " + tag + "/");
  expect_rejected(tag, "rank_00000.h5");
  tag = copy_tag("ckc_swap_run");
  sh("cp " + reference().other_ck + "/global_step2/rank_00001.h5 " + tag + "/");
  expect_rejected(tag, "rank_00001.h5");
  tag = copy_tag("ckc_old_index");
  sh("cp " + reference().ck + "/global_step1/index.h5 " + tag + "/");
  expect_rejected(tag, "index.h5");
}

TEST(CheckpointCorruption, SameLengthEditsOfTheMetadataAndManifestAreFound) {
  std::string tag = copy_tag("ckc_edit_step");
  ASSERT_TRUE(edit_bytes(tag + "/index.h5", "\"step\":2,\"tag_id\"", "\"step\":9,\"tag_id\""));
  expect_rejected(tag, "index.h5");
  tag = copy_tag("ckc_edit_opt");
  ASSERT_TRUE(edit_bytes(tag + "/index.h5", "\"optimizer_step\":2,", "\"optimizer_step\":7,"));
  expect_rejected(tag, "index.h5");
  tag = copy_tag("ckc_edit_manifest");
  ASSERT_TRUE(edit_bytes(tag + "/manifest.json", "\"shards\": 2", "\"shards\": 3"));
  expect_rejected(tag, "manifest.json");
}

TEST(CheckpointCorruption, ModelWithOtherHeadsButTheSameShapesIsRejectedOnResume) {
  const Result r = train(fresh("ckc_heads"), "--set training.steps=3 --set model.n_head=4 --set training.resume=" +
                                                 reference().ck + "/global_step2");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("global_step2/index.h5"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("n_head"), std::string::npos) << r.err;
}

TEST(CheckpointCorruption, IntactCopyStillLoadsAtAnotherWorldSize) {
  const std::string tag = copy_tag("ckc_intact");
  const Result r = train(fresh("ckc_intact_run"), "--set training.steps=3 --set training.resume=" + tag);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(run("inspect " + tag).code, 0);
}

// Format 1 (one range per shard, no manifest, no marker) still loads: a format-2 tag rewritten
// into format 1's metadata and shard attributes resumes and inspects.
TEST(CheckpointFormat, Version1CheckpointStillResumesAndInspects) {
  const std::string tag = copy_tag("ckc_v1");
  fs::remove(tag + "/manifest.json");
  fs::remove(tag + "/zero3d.tag");
  json meta;
  {
    hid_t f = H5Fopen((tag + "/index.h5").c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    std::string text;
    ASSERT_TRUE(zero3d::h5::read_attribute(f, "meta", text));
    meta = json::parse(text);
    meta["format_version"] = 1;
    meta.erase("tag_id");
    meta.erase("model");
    json ranges = json::array();
    for (const auto& segs : meta["partition_ranges"]) {
      ASSERT_EQ(segs.size(), 1u);
      ranges.push_back(segs[0]);
    }
    meta["partition_ranges"] = ranges;
    ASSERT_GE(H5Adelete(f, "meta"), 0);
    ASSERT_GE(H5Adelete(f, "format_version"), 0);
    ASSERT_GE(H5Adelete(f, "tag_id"), 0);
    zero3d::h5::write_attribute(f, "meta", meta.dump());
    zero3d::h5::write_attribute(f, "format_version", int64_t(1));
    ASSERT_GE(H5Fclose(f), 0);
  }
  for (size_t q = 0; q < meta["partition_ranges"].size(); ++q) {
    const std::string shard = tag + "/rank_0000" + std::to_string(q) + ".h5";
    hid_t f = H5Fopen(shard.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    for (const char* a : {"segments", "tag_id", "format_version"}) ASSERT_GE(H5Adelete(f, a), 0);
    zero3d::h5::write_attribute(f, "format_version", int64_t(1));
    zero3d::h5::write_attribute(f, "range_begin", meta["partition_ranges"][q][0].get<int64_t>());
    zero3d::h5::write_attribute(f, "range_end", meta["partition_ranges"][q][1].get<int64_t>());
    ASSERT_GE(H5Fclose(f), 0);
  }
  const Result i = run("inspect " + tag + " --json");
  ASSERT_EQ(i.code, 0) << i.err;
  EXPECT_EQ(json::parse(i.out)["digests"], "none (format 1)");
  const Result r = train(fresh("ckc_v1_run"), "--set training.steps=3 --set training.resume=" + tag, 2);
  EXPECT_EQ(r.code, 0) << r.err;
  // Its shards are still checked against the index: a shard from another save is found.
  sh("cp " + reference().other_ck + "/global_step2/rank_00001.h5 " + tag + "/");
  EXPECT_EQ(run("inspect " + tag).code, 2);
}

// Segments: an interleaved pipeline gives each rank two chunks of the model, so each shard holds
// two global ranges; inspect finds index.h5's virtual datasets equal to the shards.
TEST(CheckpointFormat, InterleavedPipelineShardsHoldSeveralSegmentsAndInspect) {
  const std::string out = fresh("ckc_segments");
  const Result r = train(out, "--set pipeline.stages=2 --set pipeline.schedule=interleaved --set pipeline.virtual_stages=2 "
                              "--set train_micro_batch_size_per_gpu=2", 2);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string tag = out + "/checkpoints/global_step2";
  hid_t f = H5Fopen((tag + "/rank_00000.h5").c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  std::string text;
  EXPECT_TRUE(zero3d::h5::read_attribute(f, "segments", text));
  H5Fclose(f);
  EXPECT_EQ(json::parse(text).size(), 2u) << text;
  const Result i = run("inspect " + tag);
  EXPECT_EQ(i.code, 0) << i.err;
}
