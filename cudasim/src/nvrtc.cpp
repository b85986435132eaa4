// NVRTC's API over the host C++ compiler. A program is built in two passes: the first preprocesses it
// with device.h in front and finds every `extern "C" __global__` function (their names may come from
// macros, so only the preprocessed text has them); the second compiles it into a shared object with a
// table of those kernels appended, and with GCC's outline address-sanitizer calls on every load and
// store, which the runtime checks. The "PTX" handed back names that file; cuModuleLoadData loads it.
//
// Modules are cached by a hash of everything that goes into them (CUDASIM_CACHE_DIR, default
// $XDG_CACHE_HOME/ndscope-cudasim or ~/.cache/ndscope-cudasim): the first compile of ndscope's
// kernels takes a while, later processes load the file. CUDASIM_CXX names the compiler (default c++).
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "sim.h"

extern const char cudasim_abi_h[];
extern const char cudasim_device_h[];

namespace sim {
namespace {

const char* FLAGS =
    "-std=c++17 -O1 -fPIC -shared -fno-exceptions -fno-strict-aliasing -w "
    "-fsanitize=kernel-address --param asan-instrumentation-with-call-threshold=0 "
    "--param asan-stack=0 --param asan-globals=0";

uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ull) {
    for (unsigned char c : s) {
        h ^= c;
        h *= 1099511628211ull;
    }
    return h;
}

std::string cache_dir() {
    std::string dir;
    if (const char* v = getenv("CUDASIM_CACHE_DIR")) dir = v;
    else if (const char* v = getenv("XDG_CACHE_HOME")) dir = std::string(v) + "/ndscope-cudasim";
    else if (const char* v = getenv("HOME")) dir = std::string(v) + "/.cache/ndscope-cudasim";
    else dir = "/tmp/ndscope-cudasim-" + std::to_string(getuid());
    // mkdir -p
    for (size_t i = 1; i <= dir.size(); ++i) {
        if (i == dir.size() || dir[i] == '/') mkdir(dir.substr(0, i).c_str(), 0755);
    }
    return dir;
}

bool write_file(const std::string& path, const std::string& text) {
    std::ofstream out(path, std::ios::binary);
    out << text;
    return (bool)out;
}

std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
}

// Runs `command` through the shell; its output (stdout and stderr) goes to `log`.
bool run(const std::string& command, std::string& log) {
    std::string out = command + " 2>&1";
    FILE* p = popen(out.c_str(), "r");
    if (!p) {
        log += "cudasim: cannot run the host compiler\n";
        return false;
    }
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) log.append(buf, n);
    int status = pclose(p);
    return status == 0;
}

bool is_ident(char c) { return isalnum((unsigned char)c) || c == '_'; }

// The kernels of a preprocessed program: `extern "C" CUDASIM_GLOBAL_MARK void NAME(`.
std::vector<std::string> kernel_names(const std::string& text) {
    std::vector<std::string> names;
    const std::string mark = "CUDASIM_GLOBAL_MARK";
    for (size_t at = text.find(mark); at != std::string::npos; at = text.find(mark, at + mark.size())) {
        // Only C-linkage kernels can be looked up by name, as with NVRTC without name expressions.
        size_t before = text.rfind("extern", at);
        if (before == std::string::npos || text.find_first_not_of(" \t\n\"C", before + 6) < at) continue;
        size_t i = at + mark.size();
        while (i < text.size() && isspace((unsigned char)text[i])) ++i;
        if (text.compare(i, 4, "void") != 0) continue;
        i += 4;
        while (i < text.size() && isspace((unsigned char)text[i])) ++i;
        size_t start = i;
        while (i < text.size() && is_ident(text[i])) ++i;
        std::string name = text.substr(start, i - start);
        while (i < text.size() && isspace((unsigned char)text[i])) ++i;
        if (!name.empty() && i < text.size() && text[i] == '(') names.push_back(name);
    }
    return names;
}

}  // namespace

bool compile_program(const std::string& source, const std::string& name, std::string& ptx, std::string& log) {
    // One compile at a time in a process: a second thread asking for the same program then finds the
    // first one's module in the cache instead of building it again.
    static std::mutex compiling;
    static unsigned serial = 0;
    std::lock_guard<std::mutex> guard(compiling);
    const char* cxx_env = getenv("CUDASIM_CXX");
    std::string cxx = cxx_env && *cxx_env ? cxx_env : "c++";
    std::string key = std::to_string(CUDASIM_ABI) + "\n" + cxx + "\n" + FLAGS + "\n" + cudasim_abi_h + cudasim_device_h +
                      "\n" + name + "\n" + source;
    char hash[32];
    snprintf(hash, sizeof hash, "%016llx", (unsigned long long)fnv1a(key));
    std::string dir = cache_dir();
    std::string module = dir + "/" + hash + ".so";
    ptx = "// cudasim module " + module + "\n";
    if (access(module.c_str(), R_OK) == 0) return true;

    // Private names for this process's files; the module appears under its final name by a rename.
    std::string stem = dir + "/" + hash + "." + std::to_string(getpid()) + "." + std::to_string(serial++);
    std::string include = stem + ".include";
    mkdir(include.c_str(), 0755);
    if (!write_file(include + "/abi.h", cudasim_abi_h) || !write_file(include + "/cudasim_device.h", cudasim_device_h) ||
        !write_file(stem + ".cu", "#include \"cudasim_device.h\"\n#line 1 \"" + name + "\"\n" + source + "\n")) {
        log = "cudasim: cannot write to the module cache " + dir + " (set CUDASIM_CACHE_DIR)\n";
        return false;
    }
    std::string common = cxx + " -std=c++17 -x c++ -I'" + include + "' ";
    if (!run(common + "-E -DCUDASIM_SCAN '" + stem + ".cu' -o '" + stem + ".ii'", log)) return false;
    std::vector<std::string> names = kernel_names(read_file(stem + ".ii"));
    std::string table =
        "\nextern \"C\" {\n"
        "cudasim_api cudasim_rt;\n"
        "cudasim_uint3 cudasim_thread_idx, cudasim_block_idx, cudasim_block_dim, cudasim_grid_dim;\n"
        "extern const cudasim_kernel_entry cudasim_kernels[] = {\n";
    for (const std::string& n : names) table += "CUDASIM_KERNEL(" + n + ")\n";
    table += "{nullptr, nullptr, 0, nullptr}};\n}\n";
    std::string full = read_file(stem + ".cu") + table;
    write_file(stem + ".cu", full);
    bool ok = run(cxx + " " + FLAGS + " -x c++ -I'" + include + "' '" + stem + ".cu' -o '" + stem + ".so'", log);
    if (ok) ok = rename((stem + ".so").c_str(), module.c_str()) == 0;
    unlink((stem + ".cu").c_str());
    unlink((stem + ".ii").c_str());
    unlink((include + "/abi.h").c_str());
    unlink((include + "/cudasim_device.h").c_str());
    rmdir(include.c_str());
    if (!ok) unlink((stem + ".so").c_str());
    return ok;
}

}  // namespace sim

using namespace sim;

namespace {
struct Program {
    std::string source, name, ptx, log;
};
}  // namespace

extern "C" {

enum {
    NVRTC_SUCCESS = 0,
    NVRTC_ERROR_OUT_OF_MEMORY = 1,
    NVRTC_ERROR_INVALID_INPUT = 3,
    NVRTC_ERROR_INVALID_PROGRAM = 4,
    NVRTC_ERROR_COMPILATION = 6,
};

const char* nvrtcGetErrorString(int code) {
    switch (code) {
    case NVRTC_SUCCESS: return "NVRTC_SUCCESS";
    case NVRTC_ERROR_INVALID_INPUT: return "NVRTC_ERROR_INVALID_INPUT";
    case NVRTC_ERROR_INVALID_PROGRAM: return "NVRTC_ERROR_INVALID_PROGRAM";
    case NVRTC_ERROR_COMPILATION: return "NVRTC_ERROR_COMPILATION";
    default: return "NVRTC_ERROR";
    }
}

int nvrtcVersion(int* major, int* minor) {
    *major = 12;
    *minor = 8;
    return NVRTC_SUCCESS;
}

int nvrtcCreateProgram(void** prog, const char* src, const char* name, int num_headers, const char* const*,
                       const char* const*) {
    if (!prog || !src) return NVRTC_ERROR_INVALID_INPUT;
    if (num_headers > 0) return NVRTC_ERROR_INVALID_INPUT;  // ndscope's programs include nothing
    Program* p = new Program;
    p->source = src;
    p->name = name ? name : "default_program";
    *prog = p;
    return NVRTC_SUCCESS;
}

int nvrtcDestroyProgram(void** prog) {
    if (!prog || !*prog) return NVRTC_ERROR_INVALID_PROGRAM;
    delete (Program*)*prog;
    *prog = nullptr;
    return NVRTC_SUCCESS;
}

// Options (the architecture, mostly) do not change what the host compiler builds.
int nvrtcCompileProgram(void* prog, int, const char* const*) {
    Program* p = (Program*)prog;
    if (!p) return NVRTC_ERROR_INVALID_PROGRAM;
    p->log.clear();
    return compile_program(p->source, p->name, p->ptx, p->log) ? NVRTC_SUCCESS : NVRTC_ERROR_COMPILATION;
}

int nvrtcGetPTXSize(void* prog, size_t* size) {
    *size = ((Program*)prog)->ptx.size() + 1;
    return NVRTC_SUCCESS;
}
int nvrtcGetPTX(void* prog, char* out) {
    const std::string& ptx = ((Program*)prog)->ptx;
    memcpy(out, ptx.c_str(), ptx.size() + 1);
    return NVRTC_SUCCESS;
}
int nvrtcGetProgramLogSize(void* prog, size_t* size) {
    *size = ((Program*)prog)->log.size() + 1;
    return NVRTC_SUCCESS;
}
int nvrtcGetProgramLog(void* prog, char* out) {
    const std::string& log = ((Program*)prog)->log;
    memcpy(out, log.c_str(), log.size() + 1);
    return NVRTC_SUCCESS;
}

}  // extern "C"
